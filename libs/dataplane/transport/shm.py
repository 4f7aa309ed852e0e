"""Shared-memory transport: executors on one host read each other's arenas directly.

The producer's arena is a named POSIX shared-memory segment; a consumer maps it read-only and
memcpy's the tensor's bytes into its own arena. The producer's process takes no part in the
read, like the one-sided NVSHMEM get of paper §5.2; its refcount keeps the block alive until
every consumer has released it.

The segment holds the arena's tag table after the arena, and a descriptor at its very end::

    [ arena: capacity bytes ][ tags: slots x 16 bytes ][ "T2ITAGS1" | capacity u64 (LE) ]

so a reader finds the tags with the mapping it already has, and one identity check (inode,
size) covers both. A reader checks the tensor's tag after copying (``tags.py``).
Segments are created with mode 0600: only processes of the executor's user can map them.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import shared_memory

from libs.dataplane.arena import Segment, ShmArena, reserve_segment, segment_name, unlink_segment
from libs.dataplane.errors import DataPlaneError, TransportError
from libs.dataplane.transport.base import Transport, copy_bytes
from libs.dataplane.transport.tags import TAG, TagTable, check_tag, expected_tag, slots_for, stale
from libs.protocol.tensor_meta import TensorMeta

log = logging.getLogger(__name__)

DESCRIPTOR = struct.Struct("<8sQ")
DESCRIPTOR_MAGIC = b"T2ITAGS1"


@dataclass
class _Peer:
    """A peer's mapped segment: its arena's size and a view of its tag table (empty: none)."""

    seg: Segment
    capacity: int
    tags: memoryview
    slots: int

    def close(self) -> None:
        self.tags.release()  # first, or the mapping stays exported and outlives close()
        self.seg.close()


def _layout(seg: Segment) -> _Peer:
    """Read the descriptor; a segment without one (a bare ShmArena) is all arena and has no tags."""
    if seg.size >= DESCRIPTOR.size:
        magic, capacity = DESCRIPTOR.unpack_from(seg.view, seg.size - DESCRIPTOR.size)
        room = seg.size - DESCRIPTOR.size - capacity
        if magic == DESCRIPTOR_MAGIC and 0 < capacity and room > 0 and room % TAG.size == 0:
            return _Peer(seg, capacity, seg.view[capacity : capacity + room], room // TAG.size)
    return _Peer(seg, seg.size, seg.view[0:0], 0)


class ShmTransport(Transport):
    """Creates this executor's arena as segment ``t2i-<namespace>-<executor_id>``; reads peers'.

    Peer mappings are cached in an LRU of ``max_peers`` entries. Before every read the segment's
    identity (inode, size) is checked against the cached mapping, so a peer that died (segment
    gone) raises TransportError and a peer restarted under the same name is re-mapped instead of
    read stale. The check is one shm_open+fstat, negligible next to a tensor copy.

    ``reserve`` (default) allocates the segment's pages up front, so a too-small ``/dev/shm``
    fails here with a clear error instead of SIGBUS on a later write.
    """

    kind = "shm"

    def __init__(
        self,
        namespace: str,
        executor_id: str,
        capacity: int,
        *,
        min_block: int = 256,
        max_peers: int = 32,
        reserve: bool = True,
    ) -> None:
        name = segment_name(namespace, executor_id)
        slots = slots_for(capacity, min_block)
        size = capacity + slots * TAG.size + DESCRIPTOR.size
        if unlink_segment(name):
            log.warning("removed stale shared-memory segment %s", name)
        # We own the segment (create, reserve, unlink; registered with the resource tracker so a
        # crashed executor's segment goes with its process tree); the arena maps its first
        # ``capacity`` bytes as a non-owner.
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name, create=True, size=size
        )
        try:
            if reserve:
                reserve_segment(self._shm, name, size)
            # At the end of the segment as mapped (macOS rounds sizes up to pages; readers find
            # the descriptor at st_size - 16).
            DESCRIPTOR.pack_into(self._shm.buf, self._shm.size - DESCRIPTOR.size, DESCRIPTOR_MAGIC, capacity)
            self.arena: ShmArena = ShmArena(name, capacity, create=False, min_block=min_block)
        except BaseException:
            self._destroy()
            raise
        self.tags = TagTable(self._shm.buf[capacity : capacity + slots * TAG.size], slots, name=name)
        self.address = name
        self._max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def _destroy(self) -> None:
        """Close and unlink our segment (once the arena and tags no longer view it)."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        try:
            shm.close()
        except BufferError:
            # Tensors still view the arena: keep the mapping for them, close the descriptor and
            # remove the name now, so the segment disappears with its last reader.
            shm._mmap = None  # type: ignore[attr-defined]
            fd = getattr(shm, "_fd", -1)
            if fd >= 0:
                os.close(fd)
                shm._fd = -1  # type: ignore[attr-defined]
        try:
            shm.unlink()
        except FileNotFoundError:
            pass

    def _peer(self, name: str) -> _Peer:
        """The current mapping of peer segment ``name`` (attaching or re-attaching as needed)."""
        ident = Segment.current_ident(name)
        if ident is None:
            self._forget(name)
            raise TransportError(name, "peer shared-memory segment does not exist (peer gone?)")
        with self._lock:
            if self._closed:
                raise TransportError(name, "transport is closed")
            peer = self._peers.get(name)
            if peer is not None and peer.seg.ident == ident:
                self._peers.move_to_end(name)
                return peer
        # Attach outside the lock: mapping a segment is a syscall or two, and other readers of
        # already-mapped peers need not wait for it.
        try:
            seg = Segment(name)
        except FileNotFoundError:
            self._forget(name)
            raise TransportError(name, "peer shared-memory segment does not exist (peer gone?)") from None
        except (OSError, DataPlaneError) as exc:
            raise TransportError(name, f"cannot map peer segment: {exc}") from exc
        fresh = _layout(seg)
        evicted: list[_Peer] = []
        with self._lock:
            old = self._peers.pop(name, None)
            if old is not None:
                evicted.append(old)
            self._peers[name] = fresh
            while len(self._peers) > self._max_peers:
                evicted.append(self._peers.popitem(last=False)[1])
        for gone in evicted:
            gone.close()
        return fresh

    def _forget(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
        if peer is not None:
            peer.close()

    def read(self, meta: TensorMeta, dst: memoryview) -> None:
        """memcpy ``meta.nbytes`` bytes from the peer segment ``meta.address`` into ``dst``.

        Raises TransportError for a missing peer or a range outside the peer's arena (never
        reads out of bounds), BadTensorMetaError for a non-shm meta, StaleTensorError when the
        tensor's tag (checked after the copy) no longer vouches for ``meta``.
        """
        out = self._check(meta, dst)
        if meta.nbytes == 0:
            return
        peer = self._peer(meta.address)
        end = meta.offset + meta.nbytes
        if meta.offset < 0 or end > peer.capacity:
            raise TransportError(
                meta.address,
                f"range [{meta.offset}, {end}) is outside the peer arena of {peer.capacity} bytes",
            )
        if meta.generation and meta.tag_slot >= peer.slots:
            raise stale(meta, f"tag slot {meta.tag_slot} is not in the peer's table of {peer.slots}")
        try:
            # Our own slice of the mapping: it keeps it alive even if another thread evicts this
            # peer from the cache while we copy (the tags view then fails: a retryable error).
            src = peer.seg.view[meta.offset : end]
            with src:
                copy_bytes(out, src)
            if meta.generation:
                # Checked after the copy: the producer zeroes a tag before it frees the block, so
                # a tag that still matches means nobody could have reused the block meanwhile.
                # (No check before: it would only spare copying a tensor that is already gone.)
                found = TAG.unpack_from(peer.tags, meta.tag_slot * TAG.size)
                expected = expected_tag(meta)
                if found != expected:
                    check_tag(meta, expected, found)
        except ValueError as exc:  # the mapping was evicted and released under us
            raise TransportError(meta.address, f"peer mapping went away during read: {exc}") from exc

    @property
    def peers(self) -> list[str]:
        """Names of peer segments currently mapped (most recently used last)."""
        with self._lock:
            return list(self._peers)

    def close(self) -> None:
        """Unmap peers, then close our arena and tags and unlink the segment; idempotent."""
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for peer in peers:
            peer.close()
        self.tags.close()
        self.arena.close()
        self._destroy()
