"""Integrity tags: which tensor a block of an arena holds, checked by readers after they copy.

Every tensor a :class:`~libs.dataplane.store.TensorStore` puts gets a *slot* in its transport's
tag table and the table's next *generation* (monotonic per arena); the slot holds
``(generation, key)``, ``key`` being a 64-bit hash of the tensor id, offset and size. Both numbers
travel in ``TensorMeta`` (``generation``, ``tag_slot``). The store zeroes the slot *before* it
frees the block, so a reader that copies the bytes and then still finds its ``(generation, key)``
in the slot knows the block was not freed — hence not reused — while it copied. A stale meta
(the tensor released, its block perhaps holding another tensor, another tenant's) fails with
:class:`~libs.dataplane.errors.StaleTensorError` instead of returning wrong bytes.

The table lives apart from the tensors' bytes, so no tensor's contents can forge a tag and no
block grows (a header inside a block would double every power-of-two tensor's block). Where it
lives is the transport's business: after the arena in the producer's shared-memory segment
(``shm``: readers map it with the arena), in the server's memory (``tcp``: the server checks it
before and after sending), in a second symmetric allocation (``nvshmem``). See docs/dataplane.md.

Torch-free.
"""

from __future__ import annotations

import secrets
import struct
import threading
import zlib
from collections import deque

from libs.dataplane.errors import StaleTensorError, TagTableFullError
from libs.protocol.tensor_meta import TensorMeta

#: One slot: generation (0 = empty), key. Little-endian: every reader of a table shares the
#: producer's host (shm), is the producer (tcp), or shares its architecture (nvshmem).
TAG = struct.Struct("<QQ")
#: Slots per table at most (1 MiB of tags); arenas of up to 16 MiB at 256-byte blocks never run out.
MAX_SLOTS = 1 << 16
_EMPTY = bytes(TAG.size)
_RANGE = struct.Struct("<QQ")


def slots_for(capacity: int, min_block: int) -> int:
    """Slots of an arena's tag table: one per minimum block (every live tensor holds at least
    one), at most MAX_SLOTS."""
    return max(1, min(capacity // min_block, MAX_SLOTS))


def tensor_key(tensor_id: str, offset: int, nbytes: int) -> int:
    """The 64-bit key stamped with a tensor: CRC-32 of its id, then CRC-32 of its range chained
    on it. Not cryptographic, and need not be: only producers write tags (peers map them
    read-only, tenants' bytes never land in the table) and the generation alone tells tensors
    of one table apart; the key catches metadata that names the wrong id or range. A CRC costs
    a few hundred ns on the read path, a cryptographic hash several times that.
    """
    crc = zlib.crc32(tensor_id.encode())
    return crc << 32 | zlib.crc32(_RANGE.pack(offset, nbytes), crc)


def meta_key(meta: TensorMeta) -> int:
    return tensor_key(meta.tensor_id, meta.offset, meta.nbytes)


def mismatch(slot: int, generation: int, key: int, found_generation: int, found_key: int) -> str | None:
    """Why a slot holding ``(found_generation, found_key)`` does not vouch for the tensor stamped
    ``(generation, key)`` in ``slot``; None if it does."""
    if found_generation == generation and found_key == key:
        return None
    if found_generation == 0:
        return f"tag slot {slot} is empty: the tensor was released and its block freed"
    if found_generation != generation:
        return (
            f"tag slot {slot} now holds generation {found_generation}, not {generation}: "
            "the tensor was released and its slot (maybe its block) reused"
        )
    return f"tag slot {slot} holds generation {generation} for another tensor id or range"


def stale(meta: TensorMeta, reason: str) -> StaleTensorError:
    return StaleTensorError(meta.tensor_id, meta.address, reason)


def expected_tag(meta: TensorMeta) -> tuple[int, int]:
    """What slot ``meta.tag_slot`` must hold while ``meta``'s tensor is alive."""
    crc = zlib.crc32(meta.tensor_id.encode())  # tensor_key, inlined: this is on every read
    return meta.generation, crc << 32 | zlib.crc32(_RANGE.pack(meta.offset, meta.nbytes), crc)


def check_tag(meta: TensorMeta, expected: tuple[int, int], found: tuple[int, int]) -> None:
    """Raise StaleTensorError unless the slot's content ``found`` is ``expected`` (expected_tag)."""
    if found != expected:
        raise stale(meta, mismatch(meta.tag_slot, *expected, *found) or "tag mismatch")


class TagTable:
    """The tags of one arena's live tensors, over ``view`` (``slots * 16`` bytes). Thread-safe.

    Producer side: :meth:`stamp` takes a free slot (oldest freed first, so a slot is reused as
    late as possible) and the next generation; :meth:`clear` zeroes the slot and gives it back.
    ``first_generation`` defaults to a random 48-bit number, so a producer restarted under the
    same name does not repeat its predecessor's generations.
    """

    def __init__(
        self, view: memoryview | None, slots: int, *, name: str = "", first_generation: int = 0
    ) -> None:
        if slots < 1:
            raise ValueError(f"a tag table needs at least one slot, got {slots}")
        if view is not None and view.nbytes != slots * TAG.size:
            raise ValueError(f"tag table of {slots} slots needs {slots * TAG.size} bytes, got {view.nbytes}")
        self.name = name
        self.slots = slots
        self._view = view
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(slots))
        self._held: set[int] = set()
        self._next = first_generation or 1 + secrets.randbits(48)

    def stamp(self, key: int) -> tuple[int, int]:
        """Record a new tensor with ``key``; returns ``(slot, generation)``. Call it once the
        tensor's bytes are in place. TagTableFullError when every slot is held."""
        with self._lock:
            if not self._free:
                raise TagTableFullError(self.name, self.slots)
            slot = self._free.popleft()
            generation = self._next
            self._next += 1
            self._held.add(slot)
            # Under the lock: a clear and a stamp of one slot never interleave their writes.
            self._write(slot, TAG.pack(generation, key))
        return slot, generation

    def clear(self, slot: int) -> None:
        """Zero ``slot`` and free it. Call it *before* freeing the tensor's block; a slot that is
        not held (a repeated clear) is left alone."""
        with self._lock:
            if slot not in self._held:
                return
            self._write(slot, _EMPTY)
            self._held.discard(slot)
            self._free.append(slot)

    def read(self, slot: int) -> tuple[int, int]:
        """``(generation, key)`` in ``slot`` now (0, 0 when empty)."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"tag slot {slot} is outside a table of {self.slots}")
        return TAG.unpack(self._read(slot))

    def check(self, slot: int, generation: int, key: int) -> str | None:
        """Why the table does not vouch for the tensor stamped ``(generation, key)`` in ``slot``
        now, or None if it does."""
        if not 0 <= slot < self.slots:
            return f"tag slot {slot} is outside the producer's table of {self.slots}"
        return mismatch(slot, generation, key, *self.read(slot))

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _write(self, slot: int, data: bytes) -> None:
        if self._view is not None:  # closed: the transport is gone, nobody can read the slot
            self._view[slot * TAG.size : (slot + 1) * TAG.size] = data

    def _read(self, slot: int) -> bytes | memoryview:
        if self._view is None:
            return _EMPTY  # closed: it holds nothing any more
        return self._view[slot * TAG.size : (slot + 1) * TAG.size]

    def close(self) -> None:
        """Release the view (the memory belongs to the transport); later stamps and clears only
        keep the books, reads find every slot empty."""
        view, self._view = self._view, None
        if view is not None:
            view.release()
