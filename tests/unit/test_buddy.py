"""The buddy allocator behind every executor arena (paper §5.2)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.dataplane.buddy import BuddyAllocator
from libs.dataplane.errors import ArenaFullError

KIB = 1024


def test_blocks_are_powers_of_two_and_aligned_to_their_size() -> None:
    buddy = BuddyAllocator(64 * KIB, min_block=256)
    for nbytes in (0, 1, 255, 256, 257, 1000, 4096, 5000):
        offset = buddy.alloc(nbytes)
        size = buddy.block_size(offset)
        assert size >= max(nbytes, 256)
        assert size & (size - 1) == 0
        assert offset % size == 0
        assert offset % 256 == 0


def test_a_zero_byte_request_gets_one_minimum_block() -> None:
    buddy = BuddyAllocator(4 * KIB, min_block=256)
    offset = buddy.alloc(0)
    assert buddy.block_size(offset) == 256
    assert buddy.used_bytes == 256


def test_splitting_leaves_the_rest_of_the_arena_free() -> None:
    buddy = BuddyAllocator(64 * KIB, min_block=256)
    buddy.alloc(256)
    assert buddy.free_bytes == 64 * KIB - 256
    assert buddy.largest_free == 32 * KIB


def test_exhaustion_raises_arena_full_with_the_free_and_largest_block_figures() -> None:
    buddy = BuddyAllocator(4 * KIB, min_block=256)
    buddy.alloc(2 * KIB)
    buddy.alloc(1 * KIB)
    with pytest.raises(ArenaFullError) as caught:
        buddy.alloc(2 * KIB)
    err = caught.value
    assert (err.requested, err.capacity, err.free, err.largest) == (2 * KIB, 4 * KIB, 1 * KIB, 1 * KIB)
    assert err.retryable
    assert "2048" in str(err)


def test_a_request_larger_than_the_arena_is_not_retryable() -> None:
    buddy = BuddyAllocator(4 * KIB)
    with pytest.raises(ArenaFullError) as caught:
        buddy.alloc(4 * KIB + 1)
    assert not caught.value.retryable


def test_freeing_buddies_coalesces_back_to_one_full_capacity_block() -> None:
    buddy = BuddyAllocator(16 * KIB, min_block=256)
    offsets = [buddy.alloc(256) for _ in range(64)]
    assert buddy.free_bytes == 0
    assert buddy.largest_free == 0
    for offset in offsets[::2] + offsets[1::2]:
        buddy.free(offset)
    assert buddy.free_bytes == 16 * KIB
    assert buddy.largest_free == 16 * KIB
    assert buddy.alloc(16 * KIB) == 0


def test_double_free_and_unknown_offsets_raise() -> None:
    buddy = BuddyAllocator(4 * KIB)
    offset = buddy.alloc(100)
    buddy.free(offset)
    with pytest.raises(ValueError, match="double free"):
        buddy.free(offset)
    with pytest.raises(ValueError):
        buddy.free(12345)


@pytest.mark.parametrize(
    ("capacity", "min_block"),
    [(3000, 256), (768, 256), (100, 256), (0, 256), (4096, 100)],
)
def test_capacity_that_is_not_a_power_of_two_multiple_of_min_block_is_rejected(
    capacity: int, min_block: int
) -> None:
    with pytest.raises(ValueError):
        BuddyAllocator(capacity, min_block=min_block)


def test_negative_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        BuddyAllocator(4 * KIB).alloc(-1)


# A random program of allocations (sizes) and frees (indices into the live blocks).
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=0, max_value=20 * KIB)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=1000)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=_ops,
    min_block_log=st.integers(min_value=4, max_value=9),
    orders=st.integers(min_value=0, max_value=10),
)
def test_random_programs_never_overlap_blocks_and_account_exactly(
    ops: list[tuple[str, int]], min_block_log: int, orders: int
) -> None:
    min_block = 1 << min_block_log
    capacity = min_block << orders
    buddy = BuddyAllocator(capacity, min_block=min_block)
    live: dict[int, int] = {}  # offset -> block size
    for op, arg in ops:
        if op == "alloc":
            try:
                offset = buddy.alloc(arg)
            except ArenaFullError as err:
                assert err.free == capacity - sum(live.values())
                assert err.largest < max(arg, 1) or arg > capacity
                continue
            size = buddy.block_size(offset)
            assert size >= arg and offset % min_block == 0 and offset + size <= capacity
            for other, other_size in live.items():
                assert offset + size <= other or other + other_size <= offset, "overlapping blocks"
            live[offset] = size
        elif live:
            offset = sorted(live)[arg % len(live)]
            buddy.free(offset)
            del live[offset]
        assert buddy.free_bytes == capacity - sum(live.values())
        assert buddy.used_bytes == sum(live.values())
    for offset in list(live):
        buddy.free(offset)
    assert buddy.free_bytes == capacity
    assert buddy.largest_free == capacity


# --- lazy merging ------------------------------------------------------------------------------


def test_a_freed_block_is_reused_by_the_next_request_of_its_order_without_merging() -> None:
    buddy = BuddyAllocator(1024 * KIB, min_block=256)
    offset = buddy.alloc(4 * KIB)
    buddy.free(offset)
    assert buddy.free_bytes == 1024 * KIB and buddy.allocated_blocks == 0
    assert buddy.alloc(4 * KIB) == offset
    buddy.free(offset)
    with pytest.raises(ValueError, match="double free"):
        buddy.free(offset)  # a block waiting unmerged is free, not allocated


def test_lazily_freed_blocks_merge_before_any_request_fails_and_before_largest_free() -> None:
    buddy = BuddyAllocator(16 * KIB, min_block=256, lazy=4)
    offsets = [buddy.alloc(256) for _ in range(64)]
    for offset in offsets:
        buddy.free(offset)  # four of them wait unmerged
    assert buddy.alloc(16 * KIB) == 0  # fits only once they merge
    buddy.free(0)
    small = [buddy.alloc(1 * KIB) for _ in range(4)]
    for offset in small:
        buddy.free(offset)
    assert buddy.largest_free == 16 * KIB
    with pytest.raises(ArenaFullError) as caught:
        buddy.alloc(16 * KIB + 1)
    assert not caught.value.retryable


def test_a_failed_request_reports_the_figures_of_a_merged_allocator() -> None:
    buddy = BuddyAllocator(4 * KIB, min_block=256, lazy=4)
    keep = buddy.alloc(2 * KIB)
    halves = [buddy.alloc(256) for _ in range(4)]
    for offset in halves:
        buddy.free(offset)  # cached, unmerged: 1 KiB in 256-byte pieces
    with pytest.raises(ArenaFullError) as caught:
        buddy.alloc(4 * KIB)
    assert (caught.value.free, caught.value.largest) == (2 * KIB, 2 * KIB)
    buddy.free(keep)
    assert buddy.largest_free == 4 * KIB


def test_lazy_zero_is_a_plain_buddy() -> None:
    buddy = BuddyAllocator(16 * KIB, min_block=256, lazy=0)
    buddy.free(buddy.alloc(256))
    assert buddy._free[buddy._max_order] == {0}
