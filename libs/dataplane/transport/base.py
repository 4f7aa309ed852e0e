"""The transport interface: how a consumer pulls a tensor's bytes out of a producer's arena.

Paper §5.2: a consumer "allocates a destination block from [its] local arena and pulls the
tensor bytes directly from the producer's remote address using a one-sided operation". A
:class:`Transport` owns the executor's local arena and knows how to read a peer's: shared memory
between processes on one host, TCP across hosts, NVSHMEM between GPUs of one world.
"""

from __future__ import annotations

import abc
from types import TracebackType

from libs.dataplane.arena import Arena
from libs.dataplane.transport.tags import TagTable
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import TensorMeta

#: Copies are split into chunks of this size so a multi-hundred-MiB pull gives other Python
#: threads (the executor's asyncio loop) a chance to run between chunks.
COPY_CHUNK = 8 << 20


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:len(src)] = src`` as a sequence of memcpy's of at most COPY_CHUNK bytes."""
    n = src.nbytes
    for start in range(0, n, COPY_CHUNK):
        end = min(n, start + COPY_CHUNK)
        dst[start:end] = src[start:end]


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
