"""The fast model-loading path: a converted checkpoint (:mod:`libs.dataplane.checkpoint`) from disk
(or the shared host tier) into tensors on the executor's device, layer by layer.

Two stages, each its own thread pool, so disk reads, checks and device copies overlap:

* **disk -> host.** ``disk_threads`` workers read chunk-sized ranges of the partitions with
  ``os.preadv`` (which releases the GIL) through ``O_DIRECT`` file descriptors straight into a
  page-aligned buffer, no page cache in between; a filesystem that refuses ``O_DIRECT`` (``EINVAL``
  at open or read: tmpfs before Linux 6.6, some network filesystems) is read buffered. Every chunk's CRC32C is checked as it lands (``checkpoint.checksum`` releases
  the GIL too); a mismatch or a short read fails the load with
  :class:`~libs.dataplane.errors.CorruptCheckpoint`, never hands out the bytes.
* **host -> device.** ``device_threads`` workers take landed chunks. On the CPU the host buffer *is*
  the device memory (every tensor is a view of it: zero copies) and this stage only marks progress.
  On a CUDA device it copies each chunk's pieces of tensors into one flat device buffer (tensors
  512-byte aligned there, :func:`device_layout`) on a side stream, from a small fixed pool of
  page-aligned staging chunks pinned with ``cudaHostRegister`` (or, with a host tier, from the
  tier's buffer, pinned for the copies), and waits for the copy before it counts the chunk.

Layers. The checkpoint stores tensors in execution order, so "layer ``L`` is ready" means "every
chunk before ``L``'s end has landed": ``layer_ready[L]`` (a ``threading.Event``) is set in layer
order as the prefix grows, and a forward may start on the first blocks while the rest still loads
(the paper, ServerlessT2I, §5). On CUDA, ``cuda_events[L]`` is also recorded on the copy stream.

Host tier. With a ``host_tier`` (:class:`libs.dataplane.hosttier.HostTier`) the flat host buffer
is a block of the box-wide shared tier: ``host_tier.get_or_fill(key, nbytes, fill, tags)`` returns a
block whose ``buf`` holds the bytes; ``fill(buf)`` (the disk -> host stage above, into ``buf``) runs
only on a miss, at most once per box, and keeps no view of ``buf`` once it returns. A hit costs no
disk read at all (``source == "host"``). The key is :func:`~libs.dataplane.checkpoint.checkpoint_id`
(the checkpoint's real path and index content), the tags the loader's, the call's and
``ckpt:<component folder>``. On the CPU the tensors view the block (``torch.frombuffer``: the mapping
lives as long as they do); on CUDA the block only feeds the device copies. The block's lease is held
until the :class:`LoadedCheckpoint` is closed, which happens when the model is dropped.

torch is imported inside functions: ``libs.dataplane`` stays importable without it.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import mmap
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libs.dataplane.checkpoint import (
    DEFAULT_CHUNK_BYTES,
    PAGE,
    Index,
    check_sizes,
    checkpoint_id,
    checksum,
    read_index,
)
from libs.dataplane.errors import CorruptCheckpoint

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def buffer_address(buf: Any) -> int:
    """The address of a buffer's first byte, read-only ones included (holds no export once it
    returns)."""
    import numpy as np

    if len(memoryview(buf)) == 0:
        return 0
    array = np.frombuffer(buf, dtype=np.uint8)
    try:
        return int(array.ctypes.data)
    finally:
        del array


def _host_tensor(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of memory at ``addr`` that someone else keeps alive."""
    import numpy as np
    import torch

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
    return torch.from_numpy(array)


DEVICE_ALIGN = 512  # tensor offsets in a device buffer: as the CUDA caching allocator aligns them


def device_layout(index: Index) -> tuple[dict[str, int], int]:
    """Where each stored tensor goes in a flat *device* buffer (offsets aligned to DEVICE_ALIGN, so
    kernels see the alignment ``.to("cuda")`` would give), and the buffer's size. The host layout
    keeps the source's address residues instead (:mod:`libs.dataplane.checkpoint`, "Alignment")."""
    offsets: dict[str, int] = {}
    at = 0
    for e in index.tensors:
        if e.alias_of is None:
            at = -(-at // DEVICE_ALIGN) * DEVICE_ALIGN
            offsets[e.name] = at
            at += e.nbytes
    return offsets, at


def views(index: Index, flat: torch.Tensor, offsets: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``index`` as a view of ``flat``: the partitions back to back (the host
    layout), or at ``offsets`` (:func:`device_layout`); an alias is the very tensor object of the
    name it aliases."""
    import torch

    bases = index.partition_bases()
    out: dict[str, torch.Tensor] = {}
    for e in index.tensors:
        if e.alias_of is not None:
            out[e.name] = out[e.alias_of]
            continue
        at = offsets[e.name] if offsets is not None else bases[e.partition] + e.offset
        out[e.name] = flat[at : at + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
    return out


def _segments(
    index: Index, chunks: list[_Chunk], offsets: dict[str, int]
) -> list[list[tuple[int, int, int]]]:
    """Per chunk, the pieces of tensors it holds: (start, end) within the chunk and where the
    piece goes in the device buffer."""
    bases = index.partition_bases()
    spans = sorted(
        (bases[e.partition] + e.offset, e.nbytes, offsets[e.name])
        for e in index.tensors
        if e.alias_of is None and e.nbytes
    )
    out: list[list[tuple[int, int, int]]] = []
    first = 0
    for c in chunks:
        lo, hi = c.flat, c.flat + c.nbytes
        pieces = []
        while first < len(spans) and spans[first][0] + spans[first][1] <= lo:
            first += 1
        j = first
        while j < len(spans) and spans[j][0] < hi:
            start, n, dev = spans[j]
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                pieces.append((a - lo, b - lo, dev + a - start))
            j += 1
        out.append(pieces)
    return out


class _Chunk:
    __slots__ = ("partition", "number", "file_offset", "nbytes", "flat")

    def __init__(self, partition: int, number: int, file_offset: int, nbytes: int, flat: int) -> None:
        self.partition = partition
        self.number = number
        self.file_offset = file_offset
        self.nbytes = nbytes
        self.flat = flat


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


class _StagingPool:
    """A fixed pool of page-aligned chunks (one anonymous mmap), pinned for DMA on CUDA: disk reads
    land here and the device stage copies them out, then gives the chunk back."""

    def __init__(self, count: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._mem = mmap.mmap(-1, count * chunk_bytes)
        self.addr = buffer_address(self._mem)
        self.host = _host_tensor(self.addr, count * chunk_bytes)
        self.pinned = _cuda_register(self.addr, count * chunk_bytes)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self._free.put(i)

    def take(self) -> int:
        return self._free.get()

    def give(self, i: int) -> None:
        self._free.put(i)

    def memory(self, i: int, nbytes: int) -> memoryview:
        return memoryview(self._mem)[i * self.chunk_bytes : i * self.chunk_bytes + nbytes]

    def tensor(self, i: int, nbytes: int) -> torch.Tensor:
        return self.host[i * self.chunk_bytes : i * self.chunk_bytes + nbytes]


_CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly


def _cuda_register(addr: int, nbytes: int, read_only: bool = False) -> bool:
    """Pin host memory in place for asynchronous copies (``cudaHostRegister``; read-only mappings,
    e.g. host-tier blocks, with ``cudaHostRegisterReadOnly``); False if it failed (copies then
    still work, synchronously)."""
    import torch

    if nbytes == 0 or not torch.cuda.is_available():
        return False
    flags = _CUDA_HOST_REGISTER_READ_ONLY if read_only else 0
    rc = torch.cuda.cudart().cudaHostRegister(addr, nbytes, flags)
    code = getattr(rc, "value", rc)
    if code != 0:
        log.warning("cudaHostRegister of %d bytes failed (error %s): copies will not overlap", nbytes, code)
        return False
    return True


def _cuda_unregister(addr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(addr)


class LoadedCheckpoint:
    """One load of a converted checkpoint: the tensors (views of one flat buffer, on the target
    device), per-layer readiness, and how it went.

    ``layer_ready[L]`` is set once layer ``L``'s bytes (and on CUDA its device copy) have landed;
    the events are set in layer order. A failed load sets every event too (nobody waits forever):
    :meth:`wait` raises the failure, and so does :meth:`wait_layer`."""

    def __init__(self, path: Path, index: Index, device: torch.device) -> None:
        self.path = path
        self.index = index
        self.device = device
        self.key = checkpoint_id(path, index)
        self.tensors: dict[str, torch.Tensor] = {}
        self.layer_ready: dict[str, threading.Event] = {
            layer.name: threading.Event() for layer in index.layers
        }
        self.cuda_events: dict[str, Any] = {}
        self.source = "disk"
        self.bytes_from_disk = 0
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.host_block: Any = None
        self._done = threading.Event()
        self._started = time.perf_counter()
        self._on_close: list[Callable[[], None]] = []
        self._closed = False

    # -- for the model's owner -------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.index.total_bytes

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> LoadedCheckpoint:
        """Block until every byte has landed; raise the load's failure if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"loading {self.path} took longer than {timeout}s")
        if self.error is not None:
            raise self.error
        return self

    def wait_layer(self, layer: str, timeout: float | None = None) -> None:
        """Block until ``layer`` has landed; raise the load's failure if it failed."""
        if not self.layer_ready[layer].wait(timeout):
            raise TimeoutError(f"layer {layer!r} of {self.path} took longer than {timeout}s")
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Release what the load holds: the host-tier block's lease (the tier may then evict the
        entry; tensors still viewing it keep their mapping). Idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._on_close:
            try:
                self._on_close.pop()()
            except Exception:  # noqa: BLE001 - releasing must go on
                log.exception("releasing %s", self.path)

    def __copy__(self) -> LoadedCheckpoint:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> LoadedCheckpoint:
        return self  # a copied model still names the one load its weights came from

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done() else "loading"
        return (
            f"LoadedCheckpoint({str(self.path)!r}, {state}, source={self.source}, "
            f"bytes_from_disk={self.bytes_from_disk}, seconds={self.seconds:.3f})"
        )

    # -- for the loader --------------------------------------------------------------------------
    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self.seconds = time.perf_counter() - self._started
        for ev in self.layer_ready.values():
            ev.set()
        self._done.set()


class _Progress:
    """Which chunks have landed; sets each layer's event once the contiguous prefix covers it."""

    def __init__(
        self, loaded: LoadedCheckpoint, chunks: list[_Chunk], on_layer: Callable[[str], None]
    ) -> None:
        self.loaded = loaded
        self.ends = [c.flat + c.nbytes for c in chunks]
        self.landed = [False] * len(chunks)
        self.next = 0  # first chunk not landed
        self.layers = loaded.index.layers
        self.next_layer = 0
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
            self.loaded.layer_ready[name].set()
            self.next_layer += 1


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
    ) -> LoadedCheckpoint:
        """Load the checkpoint in ``ckpt_dir`` onto ``device``. Returns once everything has landed
        (raising :class:`CorruptCheckpoint` on a corrupt or truncated partition), or with
        ``background`` once the tensors exist, their bytes still landing (on the CPU with a host
        tier, that is after the fill: the tier maps the bytes only then). ``tags`` go to the host
        tier entry with the loader's own and ``ckpt:<component folder>``."""
        import torch

        if self._closed:
            raise RuntimeError("the loader is closed")
        path = Path(ckpt_dir)
        index = read_index(path)
        check_sizes(path, index)  # a truncated file fails before anything is allocated
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        loaded = LoadedCheckpoint(path, index, dev)
        with self._lock:
            self.loads += 1
        if self.host_tier is None or index.total_bytes == 0:
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
            job = _ReadJob(self, loaded, buf, addr % PAGE == 0, device_flat, addr, finish=False)
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
                loaded._finish(e)
                ready.set()
                return
            loaded.host_block = block
            loaded._on_close.append(block.close)
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
                loaded._finish(None)
            elif not hit:
                ready.set()
                loaded._finish(None)  # every chunk reached the device during the fill
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
        """Start reading every chunk of ``loaded`` from disk: into ``host`` (the flat host buffer) or,
        with none, through the staging pool; on CUDA each landed chunk is copied to ``device_flat``."""
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
    ) -> LoadedCheckpoint:
        return self._base.load(ckpt_dir, device, background, (*self._tags, *tags))

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


class _ReadJob:
    """One checkpoint's chunks through the two stages."""

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
    ) -> None:
        self.loader = loader
        self.loaded = loaded
        self.host = host
        self.device_flat = device_flat
        self.host_addr = host_addr
        self.finish_loaded = finish
        self.from_disk = from_disk
        self.chunks = loader._chunks(loaded.index)
        self.files = _Files(loaded.path, loaded.index, loader.direct_io and aligned) if from_disk else None
        self.error: BaseException | None = None
        self.bytes_read = 0
        self._left = len(self.chunks)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.stream = loader._stream(device_flat.device) if device_flat is not None else None
        self.staging = (
            loader._staging_pool(loaded.index.chunk_bytes)
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
        submit = self.loader._disk.submit if self.from_disk else self.loader._device.submit
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
        self.loader._device.submit(self._device_stage, i, slot)

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
            if self.device_flat is not None:
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
            except Exception:  # noqa: BLE001 - the load itself is complete
                log.exception("releasing after loading %s", self.loaded.path)
        loaded, loader = self.loaded, self.loader
        loaded.bytes_from_disk += self.bytes_read
        with loader._lock:
            loader.disk_bytes += self.bytes_read
        self._done.set()
        if self.finish_loaded or self.error is not None:
            loaded._finish(self.error)


_default: Loader | None = None
_default_lock = threading.Lock()


def default_loader() -> Loader:
    """The process-wide loader used when a caller passes none (no host tier)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Loader()
        return _default
