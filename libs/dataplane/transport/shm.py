"""Shared-memory transport: executors on one host read each other's arenas directly.

The producer's arena is a named POSIX shared-memory segment; a consumer maps it read-only and
memcpy's the tensor's bytes into its own arena. The producer's process takes no part in the
read, like the one-sided NVSHMEM get of paper §5.2; its refcount keeps the block alive until
every consumer has released it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from libs.dataplane.arena import Segment, ShmArena, segment_name
from libs.dataplane.errors import DataPlaneError, TransportError
from libs.dataplane.transport.base import Transport, copy_bytes
from libs.protocol.tensor_meta import TensorMeta


class ShmTransport(Transport):
    """Creates this executor's arena as segment ``t2i-<namespace>-<executor_id>``; reads peers'.

    Peer mappings are cached in an LRU of ``max_peers`` entries. Before every read the segment's
    identity (inode, size) is checked against the cached mapping, so a peer that died (segment
    gone) raises TransportError and a peer restarted under the same name is re-mapped instead of
    read stale. The check is one shm_open+fstat, negligible next to a tensor copy.
    """

    kind = "shm"

    def __init__(
        self, namespace: str, executor_id: str, capacity: int, *, min_block: int = 256, max_peers: int = 32
    ) -> None:
        name = segment_name(namespace, executor_id)
        self.arena: ShmArena = ShmArena(name, capacity, create=True, min_block=min_block)
        self.address = name
        self._max_peers = max_peers
        self._peers: OrderedDict[str, Segment] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def _segment(self, name: str) -> Segment:
        """The current mapping of peer segment ``name`` (attaching or re-attaching as needed)."""
        ident = Segment.current_ident(name)
        if ident is None:
            self._forget(name)
            raise TransportError(name, "peer shared-memory segment does not exist (peer gone?)")
        with self._lock:
            if self._closed:
                raise TransportError(name, "transport is closed")
            seg = self._peers.get(name)
            if seg is not None and seg.ident == ident:
                self._peers.move_to_end(name)
                return seg
        # Attach outside the lock: mapping a segment is a syscall or two, and other readers of
        # already-mapped peers need not wait for it.
        try:
            fresh = Segment(name)
        except FileNotFoundError:
            self._forget(name)
            raise TransportError(name, "peer shared-memory segment does not exist (peer gone?)") from None
        except (OSError, DataPlaneError) as exc:
            raise TransportError(name, f"cannot map peer segment: {exc}") from exc
        evicted: list[Segment] = []
        with self._lock:
            old = self._peers.pop(name, None)
            if old is not None:
                evicted.append(old)
            self._peers[name] = fresh
            while len(self._peers) > self._max_peers:
                evicted.append(self._peers.popitem(last=False)[1])
        for seg in evicted:
            seg.close()
        return fresh

    def _forget(self, name: str) -> None:
        with self._lock:
            seg = self._peers.pop(name, None)
        if seg is not None:
            seg.close()

    def read(self, meta: TensorMeta, dst: memoryview) -> None:
        """memcpy ``meta.nbytes`` bytes from the peer segment ``meta.address`` into ``dst``.

        Raises TransportError for a missing peer or a range outside the peer's segment (never
        reads out of bounds), BadTensorMetaError for a non-shm meta.
        """
        out = self._check(meta, dst)
        if meta.nbytes == 0:
            return
        seg = self._segment(meta.address)
        end = meta.offset + meta.nbytes
        if meta.offset < 0 or end > seg.size:
            raise TransportError(
                meta.address, f"range [{meta.offset}, {end}) is outside the peer segment of {seg.size} bytes"
            )
        # Take our own slice of the mapping: it keeps the mapping alive even if another thread
        # evicts this peer from the cache while we copy.
        try:
            src = seg.view[meta.offset : end]
        except ValueError as exc:  # the mapping was evicted and released between lookup and slice
            raise TransportError(meta.address, f"peer mapping went away during read: {exc}") from exc
        with src:
            copy_bytes(out, src)

    @property
    def peers(self) -> list[str]:
        """Names of peer segments currently mapped (most recently used last)."""
        with self._lock:
            return list(self._peers)

    def close(self) -> None:
        """Unmap peers, then close (and unlink) our arena; idempotent."""
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for seg in peers:
            seg.close()
        self.arena.close()
