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
