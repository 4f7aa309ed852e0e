"""The transport interface: how a consumer pulls a tensor's bytes out of a producer's arena.

Paper §5.2: a consumer "allocates a destination block from [its] local arena and pulls the
tensor bytes directly from the producer's remote address using a one-sided operation". A
:class:`Transport` owns the executor's local arena and knows how to read a peer's: shared memory
between processes on one host, TCP across hosts, NVSHMEM between GPUs of one world.
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Callable
from types import TracebackType

from libs.dataplane.arena import Arena
from libs.dataplane.transport.tags import TagTable
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import TensorMeta

#: Copies of at least this many bytes run as one ``memmove`` with the GIL released (below it a
#: memoryview assignment is cheaper than the ctypes call). One call rather than chunks: glibc
#: switches to non-temporal stores only for copies larger than a share of the last-level cache
#: (tens of MiB), so the 8 MiB pieces this used to copy in ran at about half of memcpy's bandwidth
#: for large tensors (docs/dataplane.md, "Pull bandwidth"). Other Python threads (the executor's
#: asyncio loop) run during the copy because the GIL is released, not between pieces.
COPY_NOGIL_MIN = 1 << 20
#: The pieces the TCP transport sends large replies in (a socket timeout bounds each piece).
COPY_CHUNK = 8 << 20


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable since 3.3), to read a buffer's address."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


try:
    _get_buffer = ctypes.pythonapi.PyObject_GetBuffer
    _get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    _get_buffer.restype = ctypes.c_int
    _release_buffer = ctypes.pythonapi.PyBuffer_Release
    _release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
    _release_buffer.restype = None
    # ctypes.memmove is a CFUNCTYPE: calling it releases the GIL.
    _memmove: Callable[[int, int, int], int] | None = ctypes.memmove
except (AttributeError, OSError):  # an interpreter without the C API through ctypes (PyPy)
    _memmove = None


def address_of(view: memoryview) -> int:
    """The address of a C-contiguous buffer's first byte (read-only buffers too). The caller keeps
    ``view`` alive, and with it the export that keeps the memory mapped, while it uses the address.

    Costs a few microseconds (two C-API calls through ctypes): transports call it once per mapping
    and add offsets (``copy_bytes``'s ``dst_address`` / ``src_address``)."""
    buf = _PyBuffer()
    _get_buffer(view, ctypes.byref(buf), 0)  # PyBUF_SIMPLE: BufferError unless contiguous
    try:
        return int(buf.buf or 0)
    finally:
        _release_buffer(ctypes.byref(buf))


def copy_bytes(
    dst: memoryview, src: memoryview, dst_address: int | None = None, src_address: int | None = None
) -> None:
    """``dst[:len(src)] = src``: one memcpy, with the GIL released from COPY_NOGIL_MIN bytes up.

    ``dst_address`` / ``src_address``, when given, are the addresses of ``dst[0]`` / ``src[0]``
    (computed once per mapping by the caller): they spare two address look-ups (~5 µs) per copy.
    The views must still be the ones at those addresses: they are what keeps the memory mapped.
    Both views stay alive during the call (they are arguments: they do), so neither mapping can
    be unmapped under the copy: closing an mmap with live exports fails.
    """
    n = src.nbytes
    if n < COPY_NOGIL_MIN or _memmove is None:
        dst[:n] = src
        return
    if dst.nbytes < n or not (dst.c_contiguous and src.c_contiguous) or dst.readonly:
        raise ValueError(f"cannot copy {n} bytes into a {dst.nbytes}-byte destination")
    _memmove(
        address_of(dst) if dst_address is None else dst_address,
        address_of(src) if src_address is None else src_address,
        n,
    )


def read_staged(transport: Transport, meta: TensorMeta, out: memoryview) -> None:
    """A device transport's pull into host memory ``out`` (checked, exactly ``meta.nbytes``): into a
    staging block of its device arena, then one device-to-host copy."""
    import torch

    if meta.nbytes == 0:
        return
    staging = transport.arena.allocate(meta.nbytes)
    try:
        transport.read_into(meta, staging)
        torch.frombuffer(out, dtype=torch.uint8).copy_(transport.arena.tensor(staging, meta.nbytes))  # type: ignore[attr-defined]
    finally:
        transport.arena.free(staging)


class Transport(abc.ABC):
    """Owns the local arena and reads peers' arenas.

    Attributes: ``kind`` (goes into TensorMeta.transport), ``arena`` (the local arena, where
    our tensors live and where pulled copies land), ``address`` (goes into TensorMeta.address:
    how peers reach our arena), ``tags`` (the arena's integrity tags, stamped by the store and
    readable by peers: ``transport/tags.py``). Thread-safe: reads may run concurrently from
    several threads.
    """

    kind: str
    arena: Arena
    address: str
    tags: TagTable
    #: Copies of the bytes one pull makes on the consumer's side: shared memory memmoves the
    #: producer's block into ours once; TCP receives into our block once (the kernel's socket
    #: copies aside). Counted on each Lease (``copies``), reported by bench/dataplane.py.
    copies_per_pull: int = 1

    @abc.abstractmethod
    def read(self, meta: TensorMeta, dst: memoryview) -> None:
        """Copy ``meta.nbytes`` bytes at ``meta.offset`` of the producer's arena into ``dst``.

        One-sided: no code of the producer's process runs for it (TCP is the exception: a
        server thread in the producer answers). Raises TransportError if the peer cannot be
        read (gone, unreachable, range outside its arena). When ``meta.generation`` is set the
        producer's tag is checked after the copy (TCP's server checks before sending too):
        StaleTensorError if the tensor is no longer the one the metadata names, in which case
        ``dst`` holds garbage that must not be used.
        """

    def read_into(self, meta: TensorMeta, offset: int) -> None:
        """Pull the tensor into our own arena at ``offset`` (a block the caller allocated).

        Host transports read into a view of the block; device transports override this to copy
        device-to-device without touching host memory.
        """
        self.read(meta, self.arena.view(offset, meta.nbytes))

    def for_put(self) -> Transport:
        """The transport whose arena a new block goes to (outputs and pulled copies): this one; a
        :class:`~libs.dataplane.transport.fallback.FallbackTransport` answers the one in use."""
        return self

    def pull(self, meta: TensorMeta, dest: Transport, offset: int) -> None:
        """Pull ``meta`` into ``dest``'s arena at ``offset`` (``dest`` is what :meth:`for_put` gave)."""
        if dest is not self:
            raise ValueError(f"{self!r} cannot pull into another transport's arena ({dest!r})")
        self.read_into(meta, offset)

    def copies_for(self, meta: TensorMeta) -> int:
        """Copies one pull of ``meta`` makes on our side (``copies_per_pull`` of the transport that reads it)."""
        return self.copies_per_pull

    def close(self) -> None:
        """Stop serving and release the arena and peer connections; idempotent."""
        self.tags.close()
        self.arena.close()

    def _check(self, meta: TensorMeta, dst: memoryview) -> memoryview:
        """Shared argument checks; returns ``dst`` as a flat byte view of exactly nbytes."""
        if meta.transport != self.kind:
            raise BadTensorMetaError(
                "transport", f"{meta.transport!r} tensor cannot be read by a {self.kind!r} transport"
            )
        if dst.readonly:
            raise ValueError("destination buffer is read-only")
        flat = dst.cast("B") if dst.format != "B" or dst.ndim != 1 else dst
        if flat.nbytes < meta.nbytes:
            raise ValueError(f"destination holds {flat.nbytes} bytes, tensor has {meta.nbytes}")
        return flat[: meta.nbytes]

    def __enter__(self) -> Transport:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self.address}>"
