"""The executor's tensor store: immutable tensors in the local arena, refcounted by consumers.

Paper §5.2: "a producer writes its output tensor into [its arena] and publishes the tensor
metadata ... When a consumer first needs the tensor, [it] allocates a destination block from
[its] local arena and pulls the tensor bytes directly from the producer's remote address".
Tensors are immutable and reclaimed when no downstream node needs them: each consumer sends a
release to the producer, which frees the block when the count reaches zero.

Lifetimes the caller must respect:

* A producer's block is freed by the last ``release`` (or at once by ``discard`` /
  ``release_group``): consumers must be done with their copy (or with a zero-copy local view)
  before releasing.
* A pulled copy lives in the *consumer's* arena until ``Lease.close()``; after that the lease's
  tensor must not be used (the block is reused). A lease that is dropped without ``close()``
  frees its block once the lease and every tensor made from it are garbage (host arenas).
* Close the transport (arena) only after dropping every tensor that views it; ``close()`` does
  not wait, it leaves the mapping to the surviving tensors and removes the segment name.

Integrity: every tensor put is stamped in the transport's tag table (``transport/tags.py``) with
a fresh generation, recorded in its metadata; every free zeroes the stamp *before* the block is
freed. A consumer holding metadata of a tensor that is gone gets StaleTensorError, never the
bytes of whatever now occupies the block (docs/dataplane.md).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from libs.dataplane.errors import StaleTensorError, TensorNotFoundError
from libs.dataplane.transport.base import Transport
from libs.dataplane.transport.tags import tensor_key
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import DTYPE_SIZES, TensorMeta, check_meta

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPE_SIZES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; ValueError for dtypes the data plane does not move."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported by the data plane") from None


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ValueError for unknown names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported by the data plane") from None


def layout(tensor: torch.Tensor) -> list[int] | None:
    """The strides ``tensor``'s copy in the arena gets (``TensorMeta.strides``): its own when it is
    dense (a channels-last latent, a transposed matrix), else those of ``torch.empty_like`` (dense,
    its dims in the same order); None when they are the C-contiguous ones."""
    contiguous = _c_strides(tensor.shape)
    if list(tensor.stride()) == contiguous:
        return None
    strides = list(torch.empty_like(tensor, device="meta").stride())
    return None if strides == contiguous else strides


def _c_strides(shape: torch.Size) -> list[int]:
    """The strides torch gives a C-contiguous tensor of ``shape`` (a dim of size 0 counts as 1)."""
    out, width = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        out[i] = width
        width *= max(shape[i], 1)
    return out


def _block_tensor(
    transport: Transport,
    offset: int,
    nbytes: int,
    dtype: torch.dtype,
    shape: list[int],
    strides: list[int] | None = None,
) -> tuple[torch.Tensor, memoryview | None]:
    """A ``dtype``/``shape`` tensor viewing ``nbytes`` of the local arena at ``offset`` (no copy),
    C-contiguous or laid out with ``strides`` (dense: ``check_meta``).

    Also returns the memoryview the tensor's storage holds (host arenas), whose lifetime is that
    of every tensor derived from the block; None for device arenas and empty tensors.
    Offsets are min_block (256) aligned in page-aligned memory, so every dtype view is aligned.
    """
    arena = transport.arena
    if nbytes == 0:
        if strides is not None:
            return torch.empty_strided(shape, strides, dtype=dtype, device=arena.device), None
        return torch.empty(shape, dtype=dtype, device=arena.device), None
    if not arena.holds_tensors:
        anchor = arena.view(offset, nbytes)
        # frombuffer in the dtype directly (nbytes is a multiple of its size: check_meta), and a
        # view of the shape only when it is not the flat one: a few µs less per pull.
        flat = torch.frombuffer(anchor, dtype=dtype)
        if strides is not None:
            return flat.as_strided(shape, strides), anchor
        return (flat if len(shape) == 1 else flat.view(shape)), anchor
    raw = arena.tensor(offset, nbytes).view(dtype)  # type: ignore[attr-defined]  # device arenas
    return (raw.reshape(shape) if strides is None else raw.as_strided(shape, strides)), None


class _CopyBlock:
    """The block of one pulled copy in our arena, freed exactly once: by ``Lease.close()`` or, for
    a lease dropped without it, once ``anchor`` (what every tensor of the copy keeps alive) is
    collected. Registered in ``copies`` (which keeps it, and its weak reference, alive whoever
    drops the lease); whoever pops it from there frees the block (``dict.pop`` is atomic, so the
    GC's callback and a ``close()`` racing it cannot both). A lighter ``weakref.finalize``.
    """

    __slots__ = ("_arena", "_offset", "_copies", "_ref")

    def __init__(self, arena: Any, offset: int, copies: dict[_CopyBlock, bool], anchor: object) -> None:
        self._arena = arena
        self._offset = offset
        self._copies = copies
        self._ref: weakref.ref[Any] | None = weakref.ref(anchor, self)
        copies[self] = True

    def __call__(self, _ref: object = None) -> None:
        if self._copies.pop(self, False):
            self._ref = None  # breaks the block <-> weakref cycle
            # free_soon because the GC can call this inside the arena's own locked code.
            self._arena.free_soon(self._offset)


@dataclass
class _Entry:
    meta: TensorMeta
    offset: int
    refcount: int
    group: str
    transport: Transport  # whose arena holds the block


class Lease:
    """Access to one tensor for one consumer: ``.tensor`` plus transfer accounting.

    ``local`` is True for a zero-copy view of our own arena (nothing to free), False for a copy
    pulled from a peer into our arena (``close()`` frees it). ``copies``: how many times the bytes
    were copied to give this consumer its tensor (0 for a local view; the transport's
    ``copies_per_pull`` for a pull). ``transferred_bytes`` and
    ``transfer_s`` (wall time of the pull) feed per-tenant accounting (paper §6: transfer time
    is charged as vTime).
    """

    def __init__(
        self,
        meta: TensorMeta,
        tensor: torch.Tensor,
        *,
        local: bool,
        transferred_bytes: int = 0,
        transfer_s: float = 0.0,
        finalizer: Callable[[], object] | None = None,
        copies: int = 0,
    ) -> None:
        self.meta = meta
        self.local = local
        self.copies = copies
        self.transferred_bytes = transferred_bytes
        self.transfer_s = transfer_s
        self._tensor: torch.Tensor | None = tensor
        self._finalizer = finalizer

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError(f"lease of {self.meta.tensor_id!r} is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def on_close(self, finalizer: Callable[[], object]) -> None:
        """What frees the copy (called once by :meth:`close`, or by the GC's safety net)."""
        self._finalizer = finalizer

    def close(self) -> None:
        """Free the local copy now (idempotent). Do not use tensors obtained from it afterwards."""
        self._tensor = None
        if self._finalizer is not None:
            self._finalizer()  # frees at most once, even if the GC also gets to it

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "local" if self.local else f"copy {self.transferred_bytes}B in {self.transfer_s * 1e3:.2f}ms"
        return f"<Lease {self.meta.tensor_id!r} {kind}{' closed' if self.closed else ''}>"


class TensorStore:
    """Executor-side store of produced tensors over ``transport``'s arena. Thread-safe.

    ``put`` may block (up to ``alloc_timeout`` seconds) waiting for space; ``release``, ``discard``
    and ``release_group`` never block on allocation, so an asyncio loop may call them while a
    worker thread waits in ``put``/``open``.
    """

    def __init__(self, executor_id: str, transport: Transport, alloc_timeout: float = 30.0) -> None:
        self.executor_id = executor_id
        self.transport = transport
        self.alloc_timeout = alloc_timeout
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._groups: dict[str, set[str]] = {}
        self._pending: set[str] = set()
        self._copies: dict[_CopyBlock, bool] = {}  # pulled copies not yet freed

    # --- producer side -------------------------------------------------------------------------

    def put(self, tensor_id: str, tensor: torch.Tensor, *, consumers: int, group: str) -> TensorMeta:
        """Copy ``tensor`` into a new arena block and hold it for ``consumers`` releases.

        Any layout or device is accepted (copied onto the arena's device, densely in the tensor's
        own layout, which the metadata's ``strides`` carries to consumers: :func:`layout`; on a
        device arena a device-to-device copy, and the tensor then stays there). Waits up
        to ``alloc_timeout`` for space (ArenaFullError after that). ValueError if ``tensor_id``
        is already held or ``consumers < 1``. Returns the metadata to publish, stamped with the
        tensor's generation and tag slot once its bytes are in place.
        """
        if consumers < 1:
            raise ValueError(f"consumers must be >= 1, got {consumers}")
        if not tensor_id:
            raise ValueError("tensor_id must be non-empty")
        name = dtype_name(tensor.dtype)
        shape = list(tensor.shape)
        strides = layout(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            if tensor_id in self._entries or tensor_id in self._pending:
                raise ValueError(f"tensor {tensor_id!r} is already in the store")
            self._pending.add(tensor_id)
        # The transport whose arena holds it (one of a FallbackTransport's: the one in use now).
        tr = self.transport.for_put()
        try:
            offset = tr.arena.allocate(nbytes, timeout=self.alloc_timeout)
            try:
                if nbytes:
                    dst, _ = _block_tensor(tr, offset, nbytes, tensor.dtype, shape, strides)
                    dst.copy_(tensor.detach())
                    # On a device the copy is queued: it must land before the stamp vouches for it.
                    tr.arena.fence()
                slot, generation = tr.tags.stamp(tensor_key(tensor_id, offset, nbytes))
            except BaseException:
                tr.arena.free(offset)
                raise
            meta = TensorMeta(
                tensor_id=tensor_id,
                executor=self.executor_id,
                transport=tr.kind,
                address=tr.address,
                offset=offset,
                nbytes=nbytes,
                dtype=name,
                shape=shape,
                device=tr.arena.device,
                generation=generation,
                tag_slot=slot,
                strides=strides,
            )
            with self._lock:
                self._entries[tensor_id] = _Entry(meta, offset, consumers, group, tr)
                self._groups.setdefault(group, set()).add(tensor_id)
            return meta
        finally:
            with self._lock:
                self._pending.discard(tensor_id)

    def release(self, tensor_id: str, count: int = 1) -> bool:
        """A consumer is done: decrement the refcount; free the block at zero.

        Returns True iff this call freed the block. Unknown ids return False (a release repeated
        after a retry, or one racing ``release_group``), so callers need not deduplicate.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._lock:
            entry = self._entries.get(tensor_id)
            if entry is None:
                return False
            entry.refcount -= count
            if entry.refcount > 0:
                return False
            self._forget(tensor_id, entry)
        self._free(entry)
        return True

    def discard(self, tensor_id: str) -> bool:
        """Free ``tensor_id`` now, whatever releases it still expects.

        For outputs nobody will read: those of a node that failed after storing them, or the earlier
        output of a node that runs again. Returns True iff the tensor was held.
        """
        with self._lock:
            entry = self._entries.get(tensor_id)
            if entry is None:
                return False
            self._forget(tensor_id, entry)
        self._free(entry)
        return True

    def release_group(self, group: str) -> int:
        """Free every tensor of ``group`` (a cancelled or failed request) whatever its refcount.

        Returns how many were freed.
        """
        with self._lock:
            ids = self._groups.pop(group, set())
            entries = [self._entries.pop(tid) for tid in ids if tid in self._entries]
        for entry in entries:
            self._free(entry)
        return len(entries)

    def _free(self, entry: _Entry) -> None:
        # The stamp goes first: from then on every reader of the tensor fails, so the block may
        # be reused under a reader still copying it without that reader ever using the bytes.
        entry.transport.tags.clear(entry.meta.tag_slot)
        entry.transport.arena.free(entry.offset)

    def _forget(self, tensor_id: str, entry: _Entry) -> None:
        del self._entries[tensor_id]
        members = self._groups.get(entry.group)
        if members is not None:
            members.discard(tensor_id)
            if not members:
                del self._groups[entry.group]

    # --- consumer side -------------------------------------------------------------------------

    def open(self, meta: TensorMeta) -> Lease:
        """Access the tensor ``meta`` describes.

        Ours (``meta.executor == executor_id``): a zero-copy view of our arena; raises
        TensorNotFoundError if we no longer hold it, StaleTensorError if we hold another
        generation of it (released and put again). A peer's: allocate in our arena (waiting up
        to ``alloc_timeout``), pull the bytes with the transport, and view the local copy.
        Raises BadTensorMetaError for malformed metadata, TransportError if the pull fails,
        StaleTensorError if the producer no longer holds this tensor (its block freed, maybe
        reused), even if that happened during the pull.
        """
        check_meta(meta)
        try:
            dtype = torch_dtype(meta.dtype)
        except ValueError as exc:
            raise BadTensorMetaError("dtype", str(exc)) from None
        if meta.executor == self.executor_id:
            with self._lock:
                entry = self._entries.get(meta.tensor_id)
            if entry is None:
                raise TensorNotFoundError(meta.tensor_id)
            if meta.generation and meta.generation != entry.meta.generation:
                raise StaleTensorError(
                    meta.tensor_id,
                    meta.address,
                    f"we hold generation {entry.meta.generation} of it, the metadata names {meta.generation}",
                )
            if entry.offset != meta.offset or entry.meta.nbytes != meta.nbytes:
                raise TensorNotFoundError(meta.tensor_id)
            view, _ = _block_tensor(
                entry.transport, meta.offset, meta.nbytes, dtype, meta.shape, meta.strides
            )
            return Lease(meta, view, local=True)
        dest = self.transport.for_put()  # the copy lands in the arena our outputs go to now
        arena = dest.arena
        offset = arena.allocate(meta.nbytes, timeout=self.alloc_timeout)
        # The tensor, the lease and its safety net are made *before* the copy: after a copy of
        # megabytes this code would run with cold caches, several times slower. Nobody sees the
        # tensor before the pull has succeeded (tag checked); a failed pull frees the block.
        try:
            tensor, anchor = _block_tensor(dest, offset, meta.nbytes, dtype, meta.shape, meta.strides)
        except BaseException:
            arena.free(offset)
            raise
        lease = Lease(
            meta, tensor, local=False, transferred_bytes=meta.nbytes, copies=self.transport.copies_for(meta)
        )
        # Safety net for leases dropped without close(): free the block once nothing can see it.
        # On host arenas that is when the memoryview every derived tensor's storage holds dies;
        # elsewhere (device arenas, empty tensors) when the lease itself is collected.
        lease.on_close(_CopyBlock(arena, offset, self._copies, anchor if anchor is not None else lease))
        del tensor, anchor
        try:
            start = time.perf_counter()
            if meta.nbytes:
                self.transport.pull(meta, dest, offset)
            lease.transfer_s = time.perf_counter() - start
        except BaseException:
            lease.close()  # frees the block now: its bytes are garbage, and nobody saw them
            raise
        return lease

    # --- introspection -------------------------------------------------------------------------

    def __contains__(self, tensor_id: object) -> bool:
        with self._lock:
            return tensor_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, tensor_id: str) -> TensorMeta | None:
        """The metadata of a tensor we hold, or None."""
        with self._lock:
            entry = self._entries.get(tensor_id)
        return None if entry is None else entry.meta

    def held_in(self, transport: Transport) -> int:
        """How many tensors we hold in ``transport``'s arena (one of a FallbackTransport's pair)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.transport is transport)

    def refcount(self, tensor_id: str) -> int:
        """Releases still expected for ``tensor_id`` (0 if not held)."""
        with self._lock:
            entry = self._entries.get(tensor_id)
        return 0 if entry is None else entry.refcount

    def stats(self) -> dict[str, Any]:
        """capacity, used, free, largest_free (bytes), tensors (held for consumers), copies
        (blocks held by open or not-yet-collected leases and in-flight puts)."""
        arena = self.transport.arena.stats()
        with self._lock:
            tensors = len(self._entries)
        return {
            "capacity": arena["capacity"],
            "used": arena["used"],
            "free": arena["free"],
            "largest_free": arena["largest_free"],
            "tensors": tensors,
            "copies": max(0, arena["blocks"] - tensors),
        }
