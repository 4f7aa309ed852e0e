"""A binary buddy allocator over a fixed range of bytes (paper §5.2: each executor's arena).

Pure bookkeeping: no locking, no I/O, no memory of its own. It hands out offsets; the arena maps
them to bytes. Block ``k`` ("order k") is ``min_block << k`` bytes and starts at a multiple of its
own size, so every offset is ``min_block``-aligned and a block's buddy is ``offset ^ size``.
Freed buddies merge back, which is why a long-running executor's arena does not fragment into
unusable slivers (the paper reports zero allocation stalls at 97% utilisation with this scheme).
"""

from __future__ import annotations

from libs.dataplane.errors import ArenaFullError


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class BuddyAllocator:
    """Allocate power-of-two blocks of ``[0, capacity)``.

    ``capacity`` must be ``min_block * 2**k`` with ``min_block`` a power of two. Every operation
    is O(log(capacity / min_block)): one free set per order plus a dict of allocated offsets.
    Not thread-safe: the arena serialises calls.
    """

    def __init__(self, capacity: int, min_block: int = 256) -> None:
        if not _is_power_of_two(min_block):
            raise ValueError(f"min_block must be a power of two, got {min_block}")
        if capacity < min_block or not _is_power_of_two(capacity):
            raise ValueError(
                f"capacity must be a power-of-two multiple of min_block={min_block}, got {capacity}"
            )
        self._capacity = capacity
        self._min_block = min_block
        self._max_order = (capacity // min_block).bit_length() - 1
        # Sets, not lists: freeing must remove an arbitrary buddy in O(1).
        self._free: list[set[int]] = [set() for _ in range(self._max_order + 1)]
        self._free[self._max_order].add(0)
        self._allocated: dict[int, int] = {}
        self._free_bytes = capacity

    # --- queries -------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def min_block(self) -> int:
        return self._min_block

    @property
    def free_bytes(self) -> int:
        """Bytes in free blocks (internal fragmentation of allocated blocks counts as used)."""
        return self._free_bytes

    @property
    def used_bytes(self) -> int:
        return self._capacity - self._free_bytes

    @property
    def largest_free(self) -> int:
        """Size of the largest free block: the largest request that succeeds now (0 when full)."""
        for order in range(self._max_order, -1, -1):
            if self._free[order]:
                return self._min_block << order
        return 0

    @property
    def allocated_blocks(self) -> int:
        return len(self._allocated)

    def block_size(self, offset: int) -> int:
        """Size of the allocated block at ``offset`` (ValueError if none starts there)."""
        order = self._allocated.get(offset)
        if order is None:
            raise ValueError(f"no allocated block at offset {offset}")
        return self._min_block << order

    def order_for(self, nbytes: int) -> int:
        """Smallest order whose block holds ``nbytes`` (``nbytes`` must not exceed capacity)."""
        blocks = max(1, -(-nbytes // self._min_block))
        return (blocks - 1).bit_length()

    # --- operations ----------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        """Reserve a block of at least ``nbytes`` (0 gets a minimum block); return its offset.

        Raises ArenaFullError (with the free and largest-block figures) when no block fits.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes})")
        if nbytes > self._capacity:
            raise ArenaFullError(nbytes, self._capacity, self._free_bytes, self.largest_free)
        want = self.order_for(nbytes)
        order = want
        while order <= self._max_order and not self._free[order]:
            order += 1
        if order > self._max_order:
            raise ArenaFullError(nbytes, self._capacity, self._free_bytes, self.largest_free)
        offset = self._free[order].pop()
        # Split down to the wanted order, returning each upper half to its free set.
        while order > want:
            order -= 1
            self._free[order].add(offset + (self._min_block << order))
        self._allocated[offset] = want
        self._free_bytes -= self._min_block << want
        return offset

    def free(self, offset: int) -> None:
        """Return the block at ``offset``, merging it with its buddy as far up as possible.

        Raises ValueError for an offset that is not an allocated block (double free, bad offset).
        """
        order = self._allocated.pop(offset, None)
        if order is None:
            raise ValueError(f"free of offset {offset}: not an allocated block (double free?)")
        self._free_bytes += self._min_block << order
        while order < self._max_order:
            buddy = offset ^ (self._min_block << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)
