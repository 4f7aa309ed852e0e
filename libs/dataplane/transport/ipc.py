"""CUDA IPC transport: the executors of one box pull each other's tensors GPU to GPU.

Each executor allocates one device arena at start (a :class:`~libs.dataplane.device_arena.TensorArena`
over one ``cudaMalloc``): its outputs are written there and stay there, a consumer on the same
executor gets a view of the block (no copy), and a peer on the box pulls it with one
device-to-device copy (paper §5.2: the consumer allocates in its own arena and pulls from the
producer's address). What a peer needs to reach the arena, its IPC handle, is exported *once*,
into a small shared-memory segment under the executor's name (the same segment the shared-memory
transport uses, :mod:`libs.dataplane.transport.shm`): no byte of a tensor goes through it, and no
handle travels with each tensor's metadata (``TensorMeta.address`` is the segment's name)::

    [ record: RECORD_BYTES ][ tags: slots x 16 ][ incarnation | "T2IINC01" ][ "T2ITAGS1" | RECORD_BYTES ]

The record names the backend (``cuda``), the device arena's capacity, the GPU's UUID, the 64-byte
``cudaIpcMemHandle_t`` and the producer's pid. A consumer maps the segment once (identity checked
before every pull exactly as for shared memory: the segment still linked, still the incarnation it
was mapped at), opens the handle once per incarnation (``cudaIpcOpenMemHandle``; closed once the
producer is gone or replaced and no pull uses it), and copies on a side stream that first waits for
the consumer's compute stream (the destination block may have been read by queued kernels before it
was freed), then synchronises. The tensor's tag lives in host memory, in the segment, and is checked
after the copy: the producer zeroes a tag before it frees the block, and its own writes into a block
are fenced (stream synchronised) before the tag is stamped, so a tag that still matches after the
copy vouches for the bytes. A stale or reused block is refused (StaleTensorError), a peer that is
gone is a TransportError, as with shared memory.

CUDA IPC needs the processes to share an IPC namespace (for the segment) and a PID namespace, and
the consumer must see the producer's GPU: on a box every executor sees every GPU and uses the one
its lease names as ``cuda:<index>`` (docs/deploy.md). Within one process a handle cannot be opened
(CUDA refuses its own), which is why the GPU tests pull between two processes.

The CUDA calls sit behind :class:`DeviceBackend`. :class:`CudaBackend` is the real one (the CUDA
runtime that torch loaded, through ctypes); :class:`HostBackend` keeps the device arena in a
second shared-memory segment so the protocol (export, map, identity, tags, restart) runs on CPU
machines, in the tests, through the same code. Importing this module does not import torch.
"""

from __future__ import annotations

import abc
import ctypes
import logging
import os
import re
import struct
import threading
import warnings
from multiprocessing import shared_memory
from typing import Any

from libs.dataplane.arena import Segment, unlink_segment
from libs.dataplane.device_arena import TensorArena
from libs.dataplane.errors import DataPlaneError, TransportError
from libs.dataplane.transport.base import read_staged
from libs.dataplane.transport.shm import ShmTransport, _Peer
from libs.dataplane.transport.tags import TAG, check_tag, expected_tag, stale
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import TensorMeta

log = logging.getLogger(__name__)

#: ``(magic, backend, capacity, pid, uuid, handle length, handle)`` at the start of the segment.
RECORD = struct.Struct("<8s8sQq48sH192s")
RECORD_MAGIC = b"T2IIPC01"
#: The record's room in the segment (the shared-memory transport's "arena" part), a tag-aligned size.
RECORD_BYTES = 512


class Memory(abc.ABC):
    """Device memory this process allocated (``handle``: what a peer opens it with) or a peer's
    that it opened: ``tensor`` is a flat uint8 tensor over all of it."""

    tensor: Any
    handle: bytes
    uuid: str

    @abc.abstractmethod
    def close(self) -> None:
        """Free (ours) or unmap (a peer's) the memory; the tensor must no longer be used."""


class DeviceBackend(abc.ABC):
    """Allocation, export, mapping and copies of device memory for :class:`CudaIpcTransport`."""

    #: Written into the record; a consumer refuses a producer of another backend.
    name: str
    device: str

    @abc.abstractmethod
    def allocate(self, capacity: int, label: str) -> Memory:
        """``capacity`` bytes of device memory, exportable to the box's other processes."""

    @abc.abstractmethod
    def open(self, handle: bytes, uuid: str, capacity: int) -> Memory:
        """Map a peer's exported memory (TransportError when it cannot be mapped here)."""

    @abc.abstractmethod
    def copy(self, dst: Any, src: Any) -> None:
        """``dst.copy_(src)``, returned once the bytes have landed (on CUDA: on a side stream that
        waits for the current stream first)."""

    @abc.abstractmethod
    def fence(self) -> None:
        """Wait until the writes this thread queued on the device have landed."""


# -- the host stand-in ------------------------------------------------------------------------------


class _HostMemory(Memory):
    def __init__(
        self, tensor: Any, handle: bytes, owner: shared_memory.SharedMemory | None, seg: Any
    ) -> None:
        self.tensor = tensor
        self.handle = handle
        self.uuid = "host"
        self._owner = owner
        self._seg = seg

    def close(self) -> None:
        self.tensor = None
        owner, self._owner = self._owner, None
        seg, self._seg = self._seg, None
        if seg is not None:
            seg.close()
        if owner is not None:
            try:
                owner.close()
            except BufferError:  # a tensor still views it: unmapped with it
                pass
            try:
                owner.unlink()
            except FileNotFoundError:
                pass


class HostBackend(DeviceBackend):
    """The device arena in host shared memory (segment ``<label>-dev``): what the CPU tests run the
    IPC protocol over. Not for production: the shared-memory transport does the same with less."""

    name = "host"
    device = "cpu"

    def allocate(self, capacity: int, label: str) -> Memory:
        import torch

        name = f"{label}-dev"
        unlink_segment(name)
        shm = shared_memory.SharedMemory(name, create=True, size=capacity)
        tensor = torch.frombuffer(shm.buf, dtype=torch.uint8)
        return _HostMemory(tensor, name.encode(), shm, None)

    def open(self, handle: bytes, uuid: str, capacity: int) -> Memory:
        import torch

        name = handle.decode("ascii", "replace")
        if uuid != "host" or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise TransportError(name, f"not a host-backend export ({uuid!r}, {name!r})")
        try:
            seg = Segment(name)
        except (OSError, DataPlaneError) as exc:
            raise TransportError(name, f"cannot map the peer's device arena: {exc}") from exc
        if seg.size < capacity:
            seg.close()
            raise TransportError(
                name, f"the peer's device arena has {seg.size} bytes, its record says {capacity}"
            )
        with warnings.catch_warnings():  # read-only mapping: only ever a copy's source
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(seg.view[:capacity], dtype=torch.uint8)
        return _HostMemory(tensor, handle, None, seg)

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def fence(self) -> None:
        pass


# -- CUDA ------------------------------------------------------------------------------------------

_IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


def handle_bytes(handle: _IpcHandle) -> bytes:
    """A ``cudaIpcMemHandle_t``'s 64 bytes. Not ``handle.reserved``: a ``c_char`` array field reads
    as a C string, cut at the first NUL, and handles have NULs in them."""
    return bytes(handle)


def handle_of(data: bytes) -> _IpcHandle:
    """The ``cudaIpcMemHandle_t`` of 64 exported bytes (NULs included)."""
    if len(data) != _IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {_IPC_HANDLE_BYTES} bytes, not {len(data)}")
    return _IpcHandle.from_buffer_copy(data)


def _load_cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch is linked with (found among this process's mappings once
    torch initialised CUDA), else the first of the usual names that loads."""
    candidates: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "libcudart.so" in os.path.basename(path) and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    candidates += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    errors = []
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
            continue
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        return lib
    raise DataPlaneError(
        "CUDA IPC transport unavailable: no CUDA runtime library (" + "; ".join(errors) + ")"
    )


class _DevicePointer:
    """``__cuda_array_interface__`` of ``nbytes`` at ``ptr``: what ``torch.as_tensor`` wraps (the
    tensor keeps this object, and so nothing else, alive)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


class _CudaMemory(Memory):
    """``nbytes`` at ``ptr`` on GPU ``index``: ours (``cudaFree`` at close) or a peer's opened
    handle (``cudaIpcCloseMemHandle``)."""

    def __init__(
        self, backend: CudaBackend, index: int, ptr: int, nbytes: int, handle: bytes, uuid: str, *, ours: bool
    ) -> None:
        torch = backend.torch
        self._backend = backend
        self._index = index
        self._ptr = ptr
        self._ours = ours
        self.handle = handle
        self.uuid = uuid
        self.tensor = torch.as_tensor(_DevicePointer(ptr, nbytes), device=f"cuda:{index}")

    def close(self) -> None:
        ptr, self._ptr = self._ptr, 0
        self.tensor = None
        if not ptr:
            return
        b = self._backend
        with b.torch.cuda.device(self._index):
            b.torch.cuda.synchronize(self._index)  # nothing queued may still touch it
            if self._ours:
                b.call("cudaFree", ctypes.c_void_p(ptr))
            else:
                b.call("cudaIpcCloseMemHandle", ctypes.c_void_p(ptr))


class CudaBackend(DeviceBackend):
    """Device memory of ``device`` (``cuda:<index>``) from ``cudaMalloc``, exported with
    ``cudaIpcGetMemHandle``; copies on one side stream of that device."""

    name = "cuda"

    def __init__(self, device: str = "cuda") -> None:
        try:
            import torch
        except ImportError as exc:
            raise DataPlaneError(f"CUDA IPC transport unavailable: {exc}") from exc
        if not torch.cuda.is_available():
            raise DataPlaneError("CUDA IPC transport unavailable: no CUDA device is visible to torch")
        self.torch = torch
        dev = torch.device(device)
        if dev.type != "cuda":
            raise DataPlaneError(f"the CUDA IPC transport needs a cuda device, not {device!r}")
        self.index = torch.cuda.current_device() if dev.index is None else dev.index
        self.device = f"cuda:{self.index}"
        torch.cuda.init()
        self.lib = _load_cudart()
        self._side = torch.cuda.Stream(device=self.device)
        self._uuids: dict[str, int] = {}
        for i in range(torch.cuda.device_count()):
            self._uuids[str(torch.cuda.get_device_properties(i).uuid)] = i

    def call(self, fn: str, *args: Any) -> None:
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            msg = self.lib.cudaGetErrorString(rc) or b"?"
            raise DataPlaneError(f"{fn} failed: {msg.decode(errors='replace')} ({rc})")

    def allocate(self, capacity: int, label: str) -> Memory:
        ptr = ctypes.c_void_p()
        handle = _IpcHandle()
        with self.torch.cuda.device(self.index):
            self.call("cudaMalloc", ctypes.byref(ptr), ctypes.c_size_t(capacity))
            try:
                self.call("cudaIpcGetMemHandle", ctypes.byref(handle), ptr)
            except DataPlaneError:
                self.call("cudaFree", ptr)
                raise
        uuid = str(self.torch.cuda.get_device_properties(self.index).uuid)
        return _CudaMemory(
            self, self.index, int(ptr.value or 0), capacity, handle_bytes(handle), uuid, ours=True
        )

    def open(self, handle: bytes, uuid: str, capacity: int) -> Memory:
        if len(handle) != _IPC_HANDLE_BYTES:
            raise TransportError(uuid, f"a CUDA IPC handle is {_IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        index = self._uuids.get(uuid)
        if index is None:
            raise TransportError(
                uuid,
                "the producer's GPU is not visible to this process (every executor of a box must see every GPU)",
            )
        raw = handle_of(handle)
        ptr = ctypes.c_void_p()
        with self.torch.cuda.device(index):  # the mapping lives on the producer's GPU
            try:
                self.call(
                    "cudaIpcOpenMemHandle", ctypes.byref(ptr), raw, ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS)
                )
            except DataPlaneError as exc:
                raise TransportError(uuid, str(exc)) from exc
        return _CudaMemory(self, index, int(ptr.value or 0), capacity, handle, uuid, ours=False)

    def copy(self, dst: Any, src: Any) -> None:
        torch = self.torch
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()

    def fence(self) -> None:
        self.torch.cuda.current_stream(self.device).synchronize()


# -- the transport ---------------------------------------------------------------------------------


class _Mapping:
    """A peer's device arena opened for one incarnation of its segment; closed once replaced and
    no pull uses it any more."""

    __slots__ = ("peer", "memory", "capacity", "users", "retired", "lock")

    def __init__(self, peer: _Peer, memory: Memory, capacity: int) -> None:
        self.peer = peer
        self.memory = memory
        self.capacity = capacity
        self.users = 0
        self.retired = False
        self.lock = threading.Lock()

    def acquire(self) -> bool:
        with self.lock:
            if self.retired:
                return False
            self.users += 1
            return True

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            close = self.retired and self.users == 0
        if close:
            self.memory.close()

    def retire(self) -> None:
        with self.lock:
            if self.retired:
                return
            self.retired = True
            close = self.users == 0
        if close:
            self.memory.close()


class CudaIpcTransport(ShmTransport):
    """This executor's device arena (``capacity`` bytes on ``backend``'s device), exported once
    through segment ``t2i-<namespace>-<executor_id>``; pulls from peers' device arenas.

    ``copies_per_pull`` is 1 (one device-to-device copy into our arena); a consumer on the same
    executor gets a view (the store's local open: 0 copies).
    """

    kind = "cuda_ipc"
    copies_per_pull = 1

    def __init__(
        self,
        namespace: str,
        executor_id: str,
        capacity: int,
        *,
        backend: DeviceBackend | None = None,
        device: str = "cuda",
        min_block: int = 256,
        max_peers: int = 32,
    ) -> None:
        self.backend = backend if backend is not None else CudaBackend(device)
        self._device_capacity = capacity
        self._memory: Memory | None = None
        self._mappings: dict[str, _Mapping] = {}
        self._map_lock = threading.Lock()
        super().__init__(
            namespace, executor_id, RECORD_BYTES, min_block=min_block, max_peers=max_peers, slots_of=capacity
        )

    def _open_arena(self, name: str, capacity: int, min_block: int) -> TensorArena:
        """Allocate the device arena and write the record peers open it with into the segment."""
        memory = self.backend.allocate(self._device_capacity, name)
        self._memory = memory
        if len(memory.handle) > 192 or len(memory.uuid) > 48:
            raise DataPlaneError("device export handle does not fit the record")
        assert self._shm is not None
        RECORD.pack_into(
            self._shm.buf, 0, RECORD_MAGIC, self.backend.name.encode(), self._device_capacity, os.getpid(),
            memory.uuid.encode(), len(memory.handle), memory.handle,
        )  # fmt: skip
        return TensorArena(
            name, memory.tensor, min_block, fence=self.backend.fence, release=self._release_memory
        )

    def _release_memory(self) -> None:
        memory, self._memory = self._memory, None
        if memory is not None:
            memory.close()

    # -- reading -----------------------------------------------------------------------------------
    def _mapping(self, name: str) -> _Mapping:
        """The opened device arena of peer ``name`` for its current incarnation (acquired: the
        caller releases it), opening it when the segment is new or was replaced."""
        peer = self._peer(name)  # identity checked: linked, same incarnation (shm.py)
        with self._map_lock:
            mapping = self._mappings.get(name)
            if mapping is not None and mapping.peer is peer and mapping.acquire():
                return mapping
        if peer.capacity < RECORD.size:
            raise TransportError(name, "peer segment holds no device-arena record (not a cuda_ipc producer?)")
        magic, backend, capacity, _pid, uuid, hlen, handle = RECORD.unpack_from(peer.seg.view, 0)
        backend_name = backend.rstrip(b"\0").decode(errors="replace")
        if magic != RECORD_MAGIC:
            raise TransportError(name, "peer segment holds no device-arena record (not a cuda_ipc producer?)")
        if backend_name != self.backend.name:
            raise TransportError(
                name, f"peer exports {backend_name!r} memory, this transport maps {self.backend.name!r}"
            )
        memory = self.backend.open(
            bytes(handle[:hlen]), uuid.rstrip(b"\0").decode(errors="replace"), capacity
        )
        fresh = _Mapping(peer, memory, capacity)
        fresh.acquire()
        with self._map_lock:
            old = self._mappings.get(name)
            self._mappings[name] = fresh
        if old is not None:
            old.retire()  # the peer restarted (or was replaced): its old memory is never read again
        return fresh

    def read_into(self, meta: TensorMeta, offset: int) -> None:
        """One device-to-device copy from the peer's device arena into ours at ``offset``; the tag
        checked after it (StaleTensorError: the bytes must not be used)."""
        self._check_kind(meta)
        if meta.nbytes:
            self.read_to(meta, self.arena.tensor(offset, meta.nbytes))  # bounds-checked

    def _check_kind(self, meta: TensorMeta) -> None:
        if meta.transport != self.kind:
            raise BadTensorMetaError(
                "transport", f"{meta.transport!r} tensor cannot be read by a {self.kind!r} transport"
            )

    def read_to(self, meta: TensorMeta, dst: Any) -> None:
        """:meth:`read_into` into any flat uint8 tensor of ``meta.nbytes`` on this device (another
        transport's arena block: FallbackTransport)."""
        self._check_kind(meta)
        if meta.nbytes == 0:
            return
        if dst.numel() != meta.nbytes:
            raise ValueError(f"destination holds {dst.numel()} bytes, tensor has {meta.nbytes}")
        mapping = self._mapping(meta.address)
        try:
            end = meta.offset + meta.nbytes
            if meta.offset < 0 or end > mapping.capacity:
                raise TransportError(
                    meta.address,
                    f"range [{meta.offset}, {end}) is outside the peer arena of {mapping.capacity} bytes",
                )
            peer = mapping.peer
            if meta.generation and meta.tag_slot >= peer.slots:
                raise stale(meta, f"tag slot {meta.tag_slot} is not in the peer's table of {peer.slots}")
            expected = expected_tag(meta) if meta.generation else None
            self.backend.copy(dst, mapping.memory.tensor[meta.offset : end])
            if expected is not None:
                try:
                    found = TAG.unpack_from(peer.tags, meta.tag_slot * TAG.size)
                except ValueError as exc:  # the segment mapping was evicted and released under us
                    raise TransportError(meta.address, f"peer mapping went away during read: {exc}") from exc
                if found != expected:
                    check_tag(meta, expected, found)
        finally:
            mapping.release()

    def read(self, meta: TensorMeta, dst: memoryview) -> None:
        """Pull into host memory: into a staging block of our device arena, then to ``dst``."""
        read_staged(self, meta, self._check(meta, dst))

    def close(self) -> None:
        with self._map_lock:
            mappings = list(self._mappings.values())
            self._mappings.clear()
        for m in mappings:
            m.retire()
        super().close()
