"""Errors of the data plane (paper §5.2).

Each error carries its data as attributes and says whether retrying can help
(``libs.errors.is_retryable``), so callers decide between "wait and try again" and "fail the request".
"""

from __future__ import annotations

from libs.errors import RetryableError, T2IError


class DataPlaneError(T2IError):
    """Base of every data-plane error."""


class ArenaFullError(DataPlaneError):
    """No free block of the arena fits ``requested`` bytes.

    Retryable (blocks come back when consumers release tensors) unless the request is larger
    than the whole arena, which no amount of waiting can satisfy.
    """

    def __init__(self, requested: int, capacity: int, free: int, largest: int) -> None:
        self.requested = requested
        self.capacity = capacity
        self.free = free
        self.largest = largest
        self.retryable = requested <= capacity
        if requested > capacity:
            why = "larger than the whole arena"
        else:
            why = f"{free} bytes free, largest free block {largest}"
        super().__init__(f"arena cannot fit {requested} bytes (capacity {capacity}): {why}")


class ArenaClosedError(DataPlaneError):
    """The arena was closed (the executor is shutting down); nothing can be allocated in it."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"arena {name!r} is closed")


class TensorNotFoundError(DataPlaneError):
    """The tensor is not (or no longer) held by this store: released, cancelled, or never put."""

    def __init__(self, tensor_id: str) -> None:
        self.tensor_id = tensor_id
        super().__init__(f"tensor {tensor_id!r} is not held by this store")


class TransportError(DataPlaneError, RetryableError):
    """Pulling bytes from a peer failed (peer gone, connection lost, out-of-bounds request).

    Retryable: the peer may come back, or the scheduler may re-execute the producer.
    """

    def __init__(self, address: str, reason: str) -> None:
        self.address = address
        self.reason = reason
        super().__init__(f"transport to {address!r} failed: {reason}")


class PeerBusyError(TransportError):
    """A TCP peer turned the connection away: as many connections as it accepts are handshaking
    or serving reads (idle pooled ones are closed to make room first). Retryable; the client
    already retried a few times with a short backoff. The peer is alive: not evidence it is gone.
    """

    def __init__(self, address: str) -> None:
        super().__init__(address, "peer refused the connection: it serves too many already")


class StaleTensorError(DataPlaneError):
    """The metadata names a tensor its producer no longer holds: the block was freed (the tensor
    was released, discarded or its request cancelled) and may already hold another tensor, maybe
    another tenant's. Raised by the reader *after* it copied the bytes (docs/dataplane.md), so a
    block freed and reused during the read is caught too; the bytes read are never handed out.

    Not retryable: reading the same metadata again cannot give the tensor back.
    """

    def __init__(self, tensor_id: str, address: str, reason: str) -> None:
        self.tensor_id = tensor_id
        self.address = address
        self.reason = reason
        super().__init__(f"tensor {tensor_id!r} at {address!r} is stale: {reason}")


class TagTableFullError(DataPlaneError, RetryableError):
    """Every integrity-tag slot of an arena is held by a live tensor (at most 65536 per arena).

    Retryable: slots come back when consumers release tensors.
    """

    def __init__(self, arena: str, slots: int) -> None:
        self.arena = arena
        self.slots = slots
        super().__init__(f"arena {arena!r} holds {slots} tensors, as many as its tag table has slots")


class AuthenticationError(DataPlaneError):
    """The TCP peer and we do not share the data-plane token (``T2I_DATAPLANE_TOKEN``): it rejected
    ours, we have none and it wants one, or it could not prove it holds ours.

    Not retryable, and deliberately not a TransportError (which callers read as "the peer may be
    gone, retry or re-run the producer"): the configuration, not the network, is wrong.
    """

    def __init__(self, address: str, reason: str) -> None:
        self.address = address
        self.reason = reason
        super().__init__(f"transport to {address!r}: authentication failed: {reason}")


class CheckpointError(DataPlaneError):
    """A converted checkpoint (``libs.dataplane.checkpoint``) cannot be used as it is."""


class CorruptCheckpoint(CheckpointError):
    """Partition ``partition`` of the converted checkpoint at ``path`` does not hold what its index
    says: a chunk's CRC32 differs, or the file is shorter than the index records (``reason`` says
    which). Never handed out as weights: ``ensure_converted`` converts again from the source."""

    def __init__(self, path: str, partition: str | int, reason: str) -> None:
        self.path = str(path)
        self.partition = partition
        self.reason = reason
        super().__init__(f"checkpoint {self.path!r}, partition {partition}: {reason}")


class CheckpointMismatch(CheckpointError):
    """A converted checkpoint does not fit the model it is bound to (a tensor the model lacks, a
    parameter or buffer the checkpoint lacks, or a shape that differs); ``names`` lists them."""

    def __init__(self, path: str, model: str, reason: str, names: list[str] | None = None) -> None:
        self.path = str(path)
        self.model = model
        self.reason = reason
        self.names = list(names or [])
        shown = ", ".join(self.names[:8]) + (" ..." if len(self.names) > 8 else "")
        super().__init__(f"{model} from {self.path!r}: {reason}" + (f": {shown}" if shown else ""))


class HostTierError(DataPlaneError):
    """A host-tier request that cannot be served as asked (e.g. a key reused with another size)."""

    def __init__(self, tier: str, key: str, reason: str) -> None:
        self.tier = tier
        self.key = key
        self.reason = reason
        super().__init__(f"host tier {tier!r}, key {key!r}: {reason}")
