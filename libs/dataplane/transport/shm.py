"""Shared-memory transport: executors on one host read each other's arenas directly.

The producer's arena is a named POSIX shared-memory segment; a consumer maps it read-only and
memcpy's the tensor's bytes into its own arena. The producer's process takes no part in the
read, like the one-sided NVSHMEM get of paper §5.2; its refcount keeps the block alive until
every consumer has released it.

The segment holds the arena's tag table after the arena, then a header and a descriptor at its
very end::

    [ arena: capacity ][ tags: slots x 16 ][ incarnation u64 | "T2IINC01" ][ "T2ITAGS1" | capacity u64 ]

so a reader finds the tags with the mapping it already has. A reader checks the tensor's tag after
copying (``tags.py``).

Peer identity, checked before every read without looking the name up again: the reader keeps the
descriptor it mapped the peer's segment through and ``fstat``s it (``st_nlink == 0`` once anyone
unlinked the segment: its owner closing, a successor replacing it, the resource tracker after a
crash), and compares the segment's *incarnation* (a random nonzero number its owner stamps at
creation) with the one it read when it mapped it. An owner zeroes its incarnation before it
unlinks its segment, and an executor that finds a predecessor's segment under its name zeroes the
predecessor's before removing it; a reader that finds either check failing drops the mapping and
maps the name afresh. So a cached mapping of a segment that is gone or replaced is never read.
Segments of older producers (no ``T2IINC01`` header) get the ``fstat`` check only; older readers
take the header for one more tag slot, which no metadata names.

Segments are created with mode 0600: only processes of the executor's user can map them.
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
import sys
import threading
from collections import OrderedDict
from multiprocessing import resource_tracker, shared_memory

from libs.dataplane.arena import Arena, Segment, ShmArena, reserve_segment, segment_name, unlink_segment
from libs.dataplane.errors import DataPlaneError, TransportError
from libs.dataplane.transport.base import Transport, address_of, copy_bytes
from libs.dataplane.transport.tags import TAG, TagTable, check_tag, expected_tag, slots_for, stale
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import TensorMeta

log = logging.getLogger(__name__)

DESCRIPTOR = struct.Struct("<8sQ")
DESCRIPTOR_MAGIC = b"T2ITAGS1"
#: ``(incarnation, HEADER_MAGIC)`` just before the descriptor; incarnation 0 = retired. To a reader
#: of the previous version (which knew no header) it is one more, never referenced, tag slot.
HEADER = struct.Struct("<Q8s")
HEADER_MAGIC = b"T2IINC01"
_INCARNATION = struct.Struct("<Q")
# Keep a descriptor per mapped peer and fstat it (Linux: /dev/shm is tmpfs, st_nlink drops to 0 on
# unlink); elsewhere re-open the name on every check, as before.
_KEEP_FD = sys.platform.startswith("linux")


class _Peer:
    """A peer's mapped segment: its arena's size, a view of its tag table (empty: none), the
    mapping's address, and the incarnation read when it was mapped (``header`` -1: none)."""

    __slots__ = ("seg", "capacity", "tags", "slots", "base", "header", "incarnation")

    def __init__(
        self,
        seg: Segment,
        capacity: int,
        tags: memoryview,
        slots: int,
        header: int = -1,
        incarnation: int = 0,
    ) -> None:
        self.seg = seg
        self.capacity = capacity
        self.tags = tags
        self.slots = slots
        self.base = address_of(seg.view)
        self.header = header
        self.incarnation = incarnation

    def current(self) -> bool:
        """Whether this mapping may still be read: the segment is still linked (one fstat) and
        still holds the incarnation it held when mapped (not retired by its owner or a successor).
        False once closed."""
        seg = self.seg
        try:
            if seg.fd >= 0:
                # Segment.linked(), inlined (every read): closed -> EBADF, or a descriptor number
                # reused meanwhile, but then the view is released already and the read fails.
                if not os.fstat(seg.fd).st_nlink:
                    return False
            elif not seg.linked():
                return False
            return self.header < 0 or _INCARNATION.unpack_from(seg.view, self.header)[0] == self.incarnation
        except (OSError, ValueError):  # closed (descriptor closed, view released) under us
            return False

    def close(self) -> None:
        self.tags.release()  # first, or the mapping stays exported and outlives close()
        self.seg.close()


def _layout(seg: Segment) -> _Peer:
    """Read the descriptor; a segment without one (a bare ShmArena) is all arena and has no tags,
    one without the header (a producer of the previous version) has no incarnation."""
    if seg.size >= DESCRIPTOR.size:
        magic, capacity = DESCRIPTOR.unpack_from(seg.view, seg.size - DESCRIPTOR.size)
        room = seg.size - DESCRIPTOR.size - capacity
        if magic == DESCRIPTOR_MAGIC and 0 < capacity and room > 0 and room % TAG.size == 0:
            header = seg.size - DESCRIPTOR.size - HEADER.size
            incarnation, header_magic = HEADER.unpack_from(seg.view, header)
            if room > HEADER.size and header_magic == HEADER_MAGIC:
                room -= HEADER.size
                tags = seg.view[capacity : capacity + room]
                return _Peer(seg, capacity, tags, room // TAG.size, header, incarnation)
            return _Peer(seg, capacity, seg.view[capacity : capacity + room], room // TAG.size)
    return _Peer(seg, seg.size, seg.view[0:0], 0)


def retire_segment(name: str) -> bool:
    """Zero the incarnation of the segment now called ``name`` (a predecessor's, about to be
    removed), so that readers still mapping it stop reading it at their next check even if it
    outlives its name in their mappings. True if there was one to retire."""
    try:
        seg = Segment(name, writable=True)
    except (OSError, DataPlaneError):
        return False
    peer = _layout(seg)
    try:
        if peer.header < 0:
            return False
        _INCARNATION.pack_into(seg.view, peer.header, 0)
        return True
    finally:
        peer.close()


class ShmTransport(Transport):
    """Creates this executor's arena as segment ``t2i-<namespace>-<executor_id>``; reads peers'.

    Peer mappings are cached in an LRU of ``max_peers`` entries. Before every read the cached
    mapping is checked (the segment still linked, by one fstat of the descriptor kept with it, and
    still holding the incarnation it held when mapped: module docstring), so a peer that died
    (segment gone) raises TransportError and a peer restarted under the same name is re-mapped
    instead of read stale.

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
        slots_of: int | None = None,
    ) -> None:
        # ``slots_of``: the arena whose blocks the tag table covers when it is not the segment's
        # (the CUDA IPC transport keeps its arena on the device and only a record here: ipc.py).
        name = segment_name(namespace, executor_id)
        slots = slots_for(capacity if slots_of is None else slots_of, min_block)
        size = capacity + slots * TAG.size + HEADER.size + DESCRIPTOR.size
        # A predecessor's segment (a crashed executor's): retire it first, so readers still
        # mapping it stop reading it, then remove it.
        retire_segment(name)
        if unlink_segment(name):
            log.warning("removed stale shared-memory segment %s", name)
        # We own the segment (create, reserve, unlink; registered with the resource tracker so a
        # crashed executor's segment goes with its process tree); the arena maps its first
        # ``capacity`` bytes as a non-owner.
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name, create=True, size=size
        )
        # The segment's identity, so closing removes the name only while it still names our
        # segment (a successor under our name may have replaced it since).
        st = os.fstat(self._shm._fd)  # type: ignore[attr-defined]  # noqa: SLF001 - CPython's SharedMemory keeps its descriptor private
        self._ident = (st.st_dev, st.st_ino)
        try:
            if reserve:
                reserve_segment(self._shm, name, size)
            # At the end of the segment as mapped (macOS rounds sizes up to pages; readers find
            # the descriptor at st_size - 16).
            end = self._shm.size - DESCRIPTOR.size
            self.incarnation = secrets.randbits(64) | 1
            self._header = end - HEADER.size
            HEADER.pack_into(self._shm.buf, self._header, self.incarnation, HEADER_MAGIC)
            DESCRIPTOR.pack_into(self._shm.buf, end, DESCRIPTOR_MAGIC, capacity)
            self.arena: Arena = self._open_arena(name, capacity, min_block)
        except BaseException:
            self._destroy()
            raise
        self.tags = TagTable(self._shm.buf[capacity : capacity + slots * TAG.size], slots, name=name)
        self.address = name
        self._max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def _open_arena(self, name: str, capacity: int, min_block: int) -> Arena:
        """The arena over the segment's first ``capacity`` bytes, mapped as a non-owner."""
        arena = ShmArena(name, capacity, create=False, min_block=min_block)
        # Where pulled copies land: the address of our arena's first byte, once.
        self._arena_base = address_of(arena.buf)
        return arena

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
            shm._mmap = None  # type: ignore[attr-defined]  # noqa: SLF001 - CPython's SharedMemory keeps its mapping private
            fd = getattr(shm, "_fd", -1)
            if fd >= 0:
                os.close(fd)
                shm._fd = -1  # type: ignore[attr-defined]  # noqa: SLF001 - CPython's SharedMemory keeps its descriptor private
        now = Segment.current_ident(shm.name)
        if now is None or now[:2] != getattr(self, "_ident", None):
            # Gone, or a successor's segment under our name: removing the name would cut its
            # readers off. Nor may the resource tracker remove it when this process exits.
            log.info("segment %s now belongs to a successor (or is gone): left in place", shm.name)
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # noqa: SLF001 - CPython's SharedMemory keeps its tracker name private
            return
        try:
            shm.unlink()
        except FileNotFoundError:
            pass

    def _peer(self, name: str) -> _Peer:
        """The current mapping of peer segment ``name`` (attaching or re-attaching as needed)."""
        with self._lock:
            if self._closed:
                raise TransportError(name, "transport is closed")
            peer = self._peers.get(name)
            if peer is not None:
                self._peers.move_to_end(name)
        if peer is not None:
            if peer.current():
                return peer
            self._forget(name, peer)  # gone or replaced: never read it again
        # Attach outside the lock: mapping a segment is a syscall or two, and other readers of
        # already-mapped peers need not wait for it.
        try:
            seg = Segment(name, keep_fd=_KEEP_FD)
        except FileNotFoundError:
            raise TransportError(name, "peer shared-memory segment does not exist (peer gone?)") from None
        except (OSError, DataPlaneError) as exc:
            raise TransportError(name, f"cannot map peer segment: {exc}") from exc
        fresh = _layout(seg)
        if fresh.header >= 0 and fresh.incarnation == 0:
            fresh.close()
            raise TransportError(name, "peer shared-memory segment is retired (peer closing or replaced)")
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

    def _forget(self, name: str, peer: _Peer | None = None) -> None:
        """Drop the cached mapping of ``name`` (only if it is ``peer``, when given: another
        thread may have mapped the name afresh meanwhile) and unmap it."""
        with self._lock:
            cached = self._peers.get(name)
            if cached is None or (peer is not None and cached is not peer):
                cached = None
            else:
                del self._peers[name]
        if cached is not None:
            cached.close()

    def read(self, meta: TensorMeta, dst: memoryview) -> None:
        """memcpy ``meta.nbytes`` bytes from the peer segment ``meta.address`` into ``dst``.

        Raises TransportError for a missing peer or a range outside the peer's arena (never
        reads out of bounds), BadTensorMetaError for a non-shm meta, StaleTensorError when the
        tensor's tag (checked after the copy) no longer vouches for ``meta``.
        """
        self._read(meta, self._check(meta, dst), None)

    def read_into(self, meta: TensorMeta, offset: int) -> None:
        """``read`` into our arena at ``offset``, with the destination's address known (our
        mapping's, once) rather than looked up per copy."""
        if meta.transport != self.kind:
            raise BadTensorMetaError(
                "transport", f"{meta.transport!r} tensor cannot be read by a {self.kind!r} transport"
            )
        # The view is bounds-checked, and keeps our mapping alive during the copy.
        self._read(meta, self.arena.view(offset, meta.nbytes), self._arena_base + offset)

    def _read(self, meta: TensorMeta, out: memoryview, out_address: int | None) -> None:
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
        # The expected tag is computed before the copy, so that only a 16-byte load and a
        # compare run after it (code after a large copy runs with cold caches).
        expected = expected_tag(meta) if meta.generation else None
        try:
            # Our own slice of the mapping: it keeps it alive even if another thread evicts this
            # peer from the cache while we copy (the tags view then fails: a retryable error).
            # Taken after the identity check (_peer): a peer closed in between has its view
            # released already, and slicing it fails.
            src = peer.seg.view[meta.offset : end]
            with src:
                copy_bytes(out, src, out_address, peer.base + meta.offset)
            if expected is not None:
                # Checked after the copy: the producer zeroes a tag before it frees the block, so
                # a tag that still matches means nobody could have reused the block meanwhile.
                # (No check before: it would only spare copying a tensor that is already gone.)
                found = TAG.unpack_from(peer.tags, meta.tag_slot * TAG.size)
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
            closed, self._closed = self._closed, True
            peers = list(self._peers.values())
            self._peers.clear()
        if not closed and self._shm is not None:
            # Retire before unlinking: readers that still map the segment stop reading it now.
            _INCARNATION.pack_into(self._shm.buf, self._header, 0)
        for peer in peers:
            peer.close()
        self.tags.close()
        self.arena.close()
        self._destroy()
