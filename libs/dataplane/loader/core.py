"""The :class:`Loader` (one per executor process, shared by its models), its tagged views
(:meth:`Loader.tagged`) and the process-wide :func:`default_loader`.

torch is imported inside functions: ``libs.dataplane`` stays importable without it.
"""

from __future__ import annotations

import hashlib
import mmap
import operator
import os
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libs.dataplane.checkpoint import (
    DEFAULT_CHUNK_BYTES,
    PAGE,
    Index,
    check_sizes,
    read_index,
)
from libs.dataplane.loader.layout import _Chunk, device_layout, views
from libs.dataplane.loader.loaded import LoadedCheckpoint
from libs.dataplane.loader.readjob import _ReadJob
from libs.dataplane.loader.staging import _cuda_register, _cuda_unregister, _StagingPool, buffer_address

if TYPE_CHECKING:
    import torch


class Loader:
    """Loads converted checkpoints; one per executor process, shared by its models. Thread-safe.

    ``disk_threads`` read in parallel (``O_DIRECT`` queues several requests to the device);
    ``chunk_bytes`` sizes the staging chunks (a checkpoint is read in its index's chunks, which a
    conversion through this loader makes ``chunk_bytes``); ``device_threads`` run the host ->
    device stage. Counters: ``loads``, ``disk_bytes`` (read from disk), ``host_hits``."""

    def __init__(
        self,
        host_tier: Any = None,
        disk_threads: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        device_threads: int = 1,
        *,
        direct_io: bool = True,
        tags: Iterable[str] = (),
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise ValueError(f"chunk_bytes must be a positive multiple of {PAGE}, got {chunk_bytes}")
        self.host_tier = host_tier
        self.disk_threads = max(1, int(disk_threads))
        self.chunk_bytes = chunk_bytes
        self.device_threads = max(1, int(device_threads))
        self.direct_io = direct_io
        self.tags = tuple(tags)
        self.dtype: str | None = None  # the dtype components load in (None: as saved); see tagged()
        self.loads = 0
        self.disk_bytes = 0
        self.host_hits = 0
        self._lock = threading.Lock()
        self._disk = ThreadPoolExecutor(self.disk_threads, thread_name_prefix="t2i-disk")
        self._device = ThreadPoolExecutor(self.device_threads, thread_name_prefix="t2i-h2d")
        self._staging: dict[int, _StagingPool] = {}
        self._streams: dict[Any, Any] = {}
        self._closed = False

    def tagged(self, tags: Iterable[str], dtype: str | None = None) -> Loader:
        """This loader, adding ``tags`` to every load's host-tier entry (e.g. the model key a
        ModelFn loads for, so the tier can say which models the box holds) and, with ``dtype``,
        asking components to load in that dtype (``load_component`` converts a checkpoint variant
        per dtype). Shares the pools and the counters; closing it does nothing."""
        return _TaggedLoader(self, tuple(tags), dtype)  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the thread pools (after the loads in flight). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._disk.shutdown(wait=True)
        self._device.shutdown(wait=True)
        for pool in self._staging.values():
            if pool.pinned:
                _cuda_unregister(pool.addr)
        self._staging.clear()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- loading ---------------------------------------------------------------------------------
    def load(
        self,
        ckpt_dir: str | os.PathLike[str],
        device: Any = "cpu",
        background: bool = False,
        tags: Iterable[str] = (),
        *,
        first_layer: int = 0,
        use_host_tier: bool = True,
    ) -> LoadedCheckpoint:
        """Load the checkpoint in ``ckpt_dir`` onto ``device``. Returns once everything has landed
        (raising :class:`CorruptCheckpoint` on a corrupt or truncated partition), or with
        ``background`` once the tensors exist, their bytes still landing (on the CPU with a host
        tier, that is after the fill: the tier maps the bytes only then). ``tags`` go to the host
        tier entry with the loader's own and ``ckpt:<component folder>``.

        ``first_layer`` (0 to ``len(index.layers)``; ValueError otherwise): load only the layers
        ``index.layers[first_layer:]`` (layer-prefix caching: the caller still has the earlier ones,
        e.g. on its device). Only the chunks from the one holding ``layers[first_layer].start`` to
        the end are read and CRC-checked (and those holding tensors of the suffix tied to an earlier
        layer's, e.g. a tied head's weight); on CUDA only those are copied to the device. The
        buffer keeps its full size and every tensor its place, but **the bytes of the layers before
        ``first_layer`` are unspecified** (zero or garbage: never use those tensors); their
        ``layer_ready`` events are set at once, the others in order as their bytes land.
        ``first_layer == len(index.layers)`` reads nothing and returns done.

        With a host tier, a hit maps the tier's block as always (nothing is read, so
        ``first_layer`` saves nothing but, on CUDA, device copies), and a miss still fills the
        whole block from disk (an entry must be complete, so the next load is a hit): the partial
        read is the private path's. ``use_host_tier=False`` takes the private path even when the
        loader has a tier (the tier is not touched). ``loads`` counts the call, ``disk_bytes`` (and
        the result's ``bytes_from_disk``) the bytes really read."""
        import torch

        if self._closed:
            raise RuntimeError("the loader is closed")
        path = Path(ckpt_dir)
        index = read_index(path)
        first_layer = operator.index(first_layer)
        if not 0 <= first_layer <= len(index.layers):
            raise ValueError(
                f"first_layer={first_layer} is out of range: {path} has {len(index.layers)} layers "
                f"(0 to {len(index.layers)} allowed)"
            )
        check_sizes(path, index)  # a truncated file fails before anything is allocated
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        loaded = LoadedCheckpoint(path, index, dev, first_layer)
        with self._lock:
            self.loads += 1
        if (
            self.host_tier is None
            or not use_host_tier
            or index.total_bytes == 0
            or first_layer == len(index.layers)  # nothing to load: no tier entry to fill
        ):
            self._load_private(loaded)
        else:
            self._load_via_host_tier(loaded, background, tuple(tags))
        if not background:
            loaded.wait()
        return loaded

    def _chunks(self, index: Index) -> list[_Chunk]:
        out, base = [], 0
        for i, part in enumerate(index.partitions):
            for c in range(len(part.crc32c)):
                off = c * index.chunk_bytes
                out.append(_Chunk(i, c, off, min(index.chunk_bytes, part.nbytes - off), base + off))
            base += part.nbytes
        return out

    def _load_private(self, loaded: LoadedCheckpoint) -> None:
        """No host tier: a private page-aligned buffer (CPU), or staging chunks (CUDA)."""
        import torch

        index = loaded.index
        if loaded.device.type == "cpu":
            # Faulted in by the reads themselves, spread over the disk threads (measured faster
            # here than populating the whole mapping up front with MAP_POPULATE).
            mem = mmap.mmap(-1, max(index.total_bytes, PAGE))
            flat = torch.frombuffer(mem, dtype=torch.uint8)[: index.total_bytes]  # keeps mem alive
            loaded.tensors = views(index, flat)
            self._read(loaded, memoryview(mem), aligned=True, device_flat=None)
        else:
            offsets, size = device_layout(index)
            device_flat = torch.empty(size, dtype=torch.uint8, device=loaded.device)
            loaded.tensors = views(index, device_flat, offsets)
            self._read(loaded, None, aligned=True, device_flat=device_flat)

    def _load_via_host_tier(self, loaded: LoadedCheckpoint, background: bool, tags: tuple[str, ...]) -> None:
        """The flat host buffer is a block of the box's host tier: filled from disk on a miss (at
        most once per box), mapped as it is on a hit.

        The tier fills through a mapping of its own and hands out another (copy-on-write or
        read-only) afterwards, so CPU tensors can only view the block once ``get_or_fill`` has
        returned (``torch.frombuffer``: the mapping lives as long as they do); on CUDA the copies
        to the device run while the fill reads, from the fill's buffer, pinned for that time."""
        import torch

        index, dev = loaded.index, loaded.device
        device_flat = None
        if dev.type != "cpu":
            offsets, size = device_layout(index)
            device_flat = torch.empty(size, dtype=torch.uint8, device=dev)
            loaded.tensors = views(index, device_flat, offsets)
        ready = threading.Event()  # the tensors exist (or the load failed)
        filled: list[bool] = []

        def fill(buf: memoryview) -> None:
            filled.append(True)
            addr = buffer_address(buf)
            job = _ReadJob(
                self, loaded, buf, addr % PAGE == 0, device_flat, addr, finish=False, read_all=True
            )  # the whole block, whatever first_layer: the entry must be complete
            if device_flat is not None and _cuda_register(addr, index.total_bytes):
                job.on_end.append(lambda: _cuda_unregister(addr))  # the fill's mapping goes after this
            job.start()
            job.wait()
            if job.error is not None:
                raise job.error

        def run() -> None:
            try:
                block = self.host_tier.get_or_fill(
                    loaded.key, index.total_bytes, fill, self._tags(loaded, tags)
                )
            except BaseException as e:  # noqa: BLE001 - reported through the LoadedCheckpoint
                loaded._finish(e)  # noqa: SLF001 - a collaborator in the same package, written together with it
                ready.set()
                return
            loaded.host_block = block
            loaded._on_close.append(block.close)  # noqa: SLF001 - a collaborator in the same package, written together with it
            hit = block.hit or not filled
            if hit:  # the bytes are already in the box's memory: nothing to read from disk
                with self._lock:
                    self.host_hits += 1
                loaded.source = "host"
            if device_flat is None:  # CPU: the tier's block is the model's memory
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # a read-only block: never written
                    loaded.tensors = views(index, torch.frombuffer(block.buf, dtype=torch.uint8))
                ready.set()
                loaded._finish(None)  # noqa: SLF001 - a collaborator in the same package, written together with it
            elif not hit:
                ready.set()
                loaded._finish(None)  # every chunk reached the device during the fill  # noqa: SLF001 - a collaborator in the same package, written together with it
            else:
                ready.set()
                addr = buffer_address(block.buf)
                job = _ReadJob(self, loaded, None, True, device_flat, addr, finish=True, from_disk=False)
                if _cuda_register(addr, index.total_bytes, read_only=block.buf.readonly):
                    job.on_end.append(lambda: _cuda_unregister(addr))
                job.start()

        if background:
            threading.Thread(target=run, name="t2i-load", daemon=True).start()
            ready.wait()
        else:
            run()

    def _tags(self, loaded: LoadedCheckpoint, tags: tuple[str, ...]) -> list[str]:
        """The tier entry's tags: the loader's and the call's, and the component folder the
        checkpoint was converted from (its sha1 where the path is too long for a tag)."""
        component = str(loaded.path.parent.parent)
        if len(component) > 240:
            component = "sha1:" + hashlib.sha1(component.encode()).hexdigest()
        return sorted({*self.tags, *tags, f"ckpt:{component}"})

    def _stream(self, device: Any) -> Any:
        import torch

        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]

    def _staging_pool(self, chunk_bytes: int) -> _StagingPool:
        with self._lock:
            pool = self._staging.get(chunk_bytes)
            if pool is None:
                pool = self._staging[chunk_bytes] = _StagingPool(2 * self.disk_threads, chunk_bytes)
            return pool

    def _read(
        self,
        loaded: LoadedCheckpoint,
        host: memoryview | None,
        *,
        aligned: bool,
        device_flat: torch.Tensor | None,
    ) -> _ReadJob:
        """Start reading the chunks ``loaded`` needs (every one, or a suffix's) from disk: into
        ``host`` (the flat host buffer) or, with none, through the staging pool; on CUDA each landed
        chunk is copied to ``device_flat``."""
        job = _ReadJob(self, loaded, host, aligned, device_flat, None, finish=True)
        job.start()
        return job


class _TaggedLoader:
    """A view of a :class:`Loader` that adds tags to every load (:meth:`Loader.tagged`)."""

    def __init__(self, base: Loader, tags: tuple[str, ...], dtype: str | None = None) -> None:
        self._base = base
        self._tags = tags
        self.dtype = dtype if dtype is not None else base.dtype

    def load(
        self,
        ckpt_dir: str | os.PathLike[str],
        device: Any = "cpu",
        background: bool = False,
        tags: Iterable[str] = (),
        *,
        first_layer: int = 0,
        use_host_tier: bool = True,
    ) -> LoadedCheckpoint:
        return self._base.load(
            ckpt_dir,
            device,
            background,
            (*self._tags, *tags),
            first_layer=first_layer,
            use_host_tier=use_host_tier,
        )

    def tagged(self, tags: Iterable[str], dtype: str | None = None) -> Loader:
        return self._base.tagged((*self._tags, *tags), dtype if dtype is not None else self.dtype)

    def close(self) -> None:
        """The base loader is its owner's to close."""

    def __enter__(self) -> _TaggedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)  # counters, chunk_bytes, host_tier, ...


_default: Loader | None = None
_default_lock = threading.Lock()


def default_loader() -> Loader:
    """The process-wide loader used when a caller passes none (no host tier)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Loader()
        return _default
