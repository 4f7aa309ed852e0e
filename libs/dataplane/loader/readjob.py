"""The read job: one checkpoint's chunks through the two stages (disk -> host, host -> device),
each on its loader's thread pool (:class:`_ReadJob`); the partitions' file descriptors
(:class:`_Files`, ``O_DIRECT`` where the filesystem allows it) and the per-layer progress
(:class:`_Progress`). A load of a suffix of the layers (``LoadedCheckpoint.first_layer``) reads
only the chunks it needs (:func:`~libs.dataplane.loader.layout.needed_chunks`), unless it fills a
host-tier block, which must be whole.

torch is imported inside functions: ``libs.dataplane`` stays importable without it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from libs.dataplane.checkpoint import Index, checksum
from libs.dataplane.errors import CorruptCheckpoint
from libs.dataplane.loader.layout import _Chunk, _segments, device_layout, needed_chunks, needed_ranges
from libs.dataplane.loader.loaded import LoadedCheckpoint
from libs.dataplane.loader.staging import _host_tensor

if TYPE_CHECKING:
    import torch

    from libs.dataplane.loader.core import Loader

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _Files:
    """One checkpoint's open partitions: an ``O_DIRECT`` descriptor where the filesystem allows it,
    a buffered one otherwise (or after an ``EINVAL`` read)."""

    def __init__(self, ckpt_dir: Path, index: Index, direct: bool) -> None:
        self.paths = [ckpt_dir / p.file for p in index.partitions]
        self._lock = threading.Lock()
        self.fds: list[int] = []
        self.direct: list[bool] = []
        self._retired: list[int] = []
        try:
            for path in self.paths:
                fd, is_direct = self._open(path, direct)
                self.fds.append(fd)
                self.direct.append(is_direct)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open(path: Path, direct: bool) -> tuple[int, bool]:
        if direct and _O_DIRECT:
            try:
                return os.open(path, os.O_RDONLY | _O_DIRECT), True
            except OSError as e:
                if e.errno != errno.EINVAL:  # tmpfs and friends refuse O_DIRECT: read buffered
                    raise
        return os.open(path, os.O_RDONLY), False

    def get(self, partition: int) -> tuple[int, bool]:
        """The descriptor to read ``partition`` with, and whether it is O_DIRECT."""
        with self._lock:
            return self.fds[partition], self.direct[partition]

    def buffered(self, partition: int) -> int:
        with self._lock:
            if self.direct[partition]:
                # The O_DIRECT descriptor stays open until close(): another reader may be using it,
                # and closing it now would let a new open() reuse its number under that reader.
                self._retired.append(self.fds[partition])
                self.fds[partition], self.direct[partition] = self._open(self.paths[partition], False)
            return self.fds[partition]

    def close(self) -> None:
        for fd in self.fds + self._retired:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds, self._retired = [], []


class _Progress:
    """Which chunks have landed; sets each layer's event once the contiguous prefix covers it.

    ``chunks`` are the ones the load reads, in flat order (on a suffix load, not every chunk): a
    layer from ``loaded.first_layer`` on is ready once every one of them that starts before the
    layer's end has landed (its own bytes, and those of tensors it ties to an earlier layer, come
    before its end). The layers before ``first_layer`` were set when the load began."""

    def __init__(
        self, loaded: LoadedCheckpoint, chunks: list[_Chunk], on_layer: Callable[[str], None]
    ) -> None:
        self.loaded = loaded
        self.ends = [c.flat + c.nbytes for c in chunks]
        self.landed = [False] * len(chunks)
        self.next = 0  # first chunk not landed
        self.layers = loaded.index.layers
        self.next_layer = loaded.first_layer
        self.on_layer = on_layer
        self.lock = threading.Lock()
        self._advance(0)

    def mark(self, i: int) -> None:
        with self.lock:
            self.landed[i] = True
            while self.next < len(self.landed) and self.landed[self.next]:
                self.next += 1
            self._advance(self.ends[self.next - 1] if self.next else 0)

    def _advance(self, watermark: int) -> None:
        while self.next_layer < len(self.layers) and self.layers[self.next_layer].end <= watermark:
            name = self.layers[self.next_layer].name
            self.on_layer(name)
            self.loaded._layer_landed(name)  # noqa: SLF001 - a collaborator in the same package, written together with it
            self.next_layer += 1


class _ReadJob:
    """One checkpoint's chunks through the two stages: the chunks ``loaded`` needs (every one for
    a full load; from the one holding ``layers[first_layer].start`` on, and those holding tensors
    tied into the suffix, for a suffix load), or with ``read_all`` (a host-tier fill) every chunk
    read from disk, though only the needed ones are copied to the device."""

    def __init__(
        self,
        loader: Loader,
        loaded: LoadedCheckpoint,
        host: memoryview | None,
        aligned: bool,
        device_flat: torch.Tensor | None,
        host_addr: int | None,
        finish: bool,
        *,
        from_disk: bool = True,
        read_all: bool = False,
    ) -> None:
        self.loader = loader
        self.loaded = loaded
        self.host = host
        self.device_flat = device_flat
        self.host_addr = host_addr
        self.finish_loaded = finish
        self.from_disk = from_disk
        every = loader._chunks(loaded.index)  # noqa: SLF001 - a collaborator in the same package, written together with it
        needed = needed_chunks(every, needed_ranges(loaded.index, loaded.first_layer))
        self.chunks = every if read_all else [c for c, n in zip(every, needed, strict=True) if n]
        self.copies = needed if read_all else [True] * len(self.chunks)  # per chunk: to the device?
        self.files = _Files(loaded.path, loaded.index, loader.direct_io and aligned) if from_disk else None
        self.error: BaseException | None = None
        self.bytes_read = 0
        self._left = len(self.chunks)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.stream = loader._stream(device_flat.device) if device_flat is not None else None  # noqa: SLF001 - a collaborator in the same package, written together with it
        self.staging = (
            loader._staging_pool(loaded.index.chunk_bytes)  # noqa: SLF001 - a collaborator in the same package, written together with it
            if device_flat is not None and host is None and from_disk
            else None
        )
        self.host_tensor = (
            _host_tensor(host_addr, loaded.index.total_bytes)
            if device_flat is not None and host_addr is not None
            else None
        )
        self.segments = (
            _segments(loaded.index, self.chunks, device_layout(loaded.index)[0])
            if device_flat is not None
            else []
        )
        self.progress = _Progress(loaded, self.chunks, self._on_layer)
        self.on_end: list[Callable[[], None]] = []  # after the last chunk, before anyone is told

    def start(self) -> None:
        if not self.chunks:
            self._end()
            return
        submit = self.loader._disk.submit if self.from_disk else self.loader._device.submit  # noqa: SLF001 - a collaborator in the same package, written together with it
        for i in range(len(self.chunks)):
            submit(self._disk_stage if self.from_disk else self._device_stage, i, None)

    def wait(self) -> None:
        self._done.wait()

    # -- stage 1: disk -> host -------------------------------------------------------------------
    def _disk_stage(self, i: int, _: None) -> None:
        if self.error is not None:
            self._skip()
            return
        chunk = self.chunks[i]
        slot = None
        try:
            if self.staging is not None:
                slot = self.staging.take()
                dest = self.staging.memory(slot, chunk.nbytes)
            else:
                assert self.host is not None
                dest = self.host[chunk.flat : chunk.flat + chunk.nbytes]
            # Released before the chunk is reported: the fill's buffer must have no view left
            # once the last chunk lands (the host tier unmaps it then).
            with dest:
                self._pread(chunk, dest)
                crc = checksum(dest)
            if crc != self.loaded.index.partitions[chunk.partition].crc32c[chunk.number]:
                raise CorruptCheckpoint(
                    str(self.loaded.path),
                    chunk.partition,
                    f"chunk {chunk.number}: CRC32 differs from the index",
                )
            with self._lock:
                self.bytes_read += chunk.nbytes
        except BaseException as e:  # noqa: BLE001 - reported through the job
            if slot is not None:
                self.staging.give(slot)  # type: ignore[union-attr]
            self._fail(e)
            return
        self.loader._device.submit(self._device_stage, i, slot)  # noqa: SLF001 - a collaborator in the same package, written together with it

    def _pread(self, chunk: _Chunk, dest: memoryview) -> None:
        assert self.files is not None
        got = 0
        while got < chunk.nbytes:
            fd, direct = self.files.get(chunk.partition)
            try:
                with dest[got:] as rest:
                    n = os.preadv(fd, [rest], chunk.file_offset + got)
            except OSError as e:
                if e.errno == errno.EINVAL and direct:
                    self.files.buffered(chunk.partition)  # O_DIRECT refused here after all
                    continue
                raise
            if n == 0:
                raise CorruptCheckpoint(
                    str(self.loaded.path),
                    chunk.partition,
                    f"truncated: chunk {chunk.number} ends at {chunk.file_offset + got}, "
                    f"the index says {chunk.file_offset + chunk.nbytes}",
                )
            got += n

    # -- stage 2: host -> device -----------------------------------------------------------------
    def _device_stage(self, i: int, slot: int | None) -> None:
        if self.error is not None:
            if slot is not None:
                self.staging.give(slot)  # type: ignore[union-attr]
            self._skip()
            return
        try:
            if self.device_flat is not None and self.copies[i]:
                self._copy(i, slot)
            self.progress.mark(i)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
            return
        finally:
            if slot is not None:
                self.staging.give(slot)  # type: ignore[union-attr]
        self._skip()

    def _copy(self, i: int, slot: int | None) -> None:
        """Chunk ``i``'s pieces of tensors to their places in the device buffer, on the side stream."""
        import torch

        chunk = self.chunks[i]
        if slot is not None:
            src = self.staging.tensor(slot, chunk.nbytes)  # type: ignore[union-attr]
        else:
            assert self.host_tensor is not None
            src = self.host_tensor[chunk.flat : chunk.flat + chunk.nbytes]
        dst = self.device_flat
        assert dst is not None
        with torch.cuda.stream(self.stream):
            for a, b, at in self.segments[i]:
                dst[at : at + b - a].copy_(src[a:b], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # the staging chunk is free again and the layer's bytes are on the device

    def _on_layer(self, name: str) -> None:
        if self.stream is not None:
            import torch

            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.loaded.cuda_events[name] = ev

    # -- the end ---------------------------------------------------------------------------------
    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = e
        self._skip()

    def _skip(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._end()

    def _end(self) -> None:
        if self.files is not None:
            self.files.close()
        self.host = self.host_tensor = None  # no view of a host-tier fill buffer outlives the fill
        for release in self.on_end:
            try:
                release()
            except Exception:
                log.exception("releasing after loading %s", self.loaded.path)
        loaded, loader = self.loaded, self.loader
        loaded.bytes_from_disk += self.bytes_read
        with loader._lock:  # noqa: SLF001 - a collaborator in the same package, written together with it
            loader.disk_bytes += self.bytes_read
        self._done.set()
        if self.finish_loaded or self.error is not None:
            loaded._finish(self.error)  # noqa: SLF001 - a collaborator in the same package, written together with it
