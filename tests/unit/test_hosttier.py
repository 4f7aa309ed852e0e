"""The host tier in one process: hits and misses, LRU under the budget, leases, uncached blocks, tags.

The tier's files live in the real ``/dev/shm``; each test has its own tier name and destroys it.
Several processes sharing a tier are in ``tests/integration/test_hosttier_processes.py``.
"""

from __future__ import annotations

import ctypes
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from libs.dataplane.errors import DataPlaneError
from libs.dataplane.hosttier import PAGE, HostBlock, HostTier, HostTierError

ROOT = Path("/dev/shm")
BOUND = 20.0  # upper bound on waits for another thread


def _files(name: str) -> list[str]:
    return sorted(p.name for p in ROOT.glob(f"t2i-hosttier-{name}.*"))


def _segments(name: str) -> list[str]:
    return [f for f in _files(name) if ".seg-" in f]


@pytest.fixture
def name() -> Iterator[str]:
    tier_name = f"test{uuid.uuid4().hex[:10]}"
    yield tier_name
    HostTier.destroy(tier_name)
    assert not _files(tier_name)


@pytest.fixture
def tiers(name: str) -> Iterator[Callable[..., HostTier]]:
    """Opens tiers of this test's name (closed at teardown)."""
    made: list[HostTier] = []

    def make(budget: int = 8 * PAGE, **kwargs: object) -> HostTier:
        tier = HostTier(name, budget, **kwargs)  # type: ignore[arg-type]
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


class Filler:
    """A fill function that records its calls and writes a pattern derived from the key."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, key: str) -> Callable[[memoryview], None]:
        def fill(buf: memoryview) -> None:
            self.calls.append(len(buf))
            buf[:] = pattern(key, len(buf))

        return fill


def pattern(key: str, nbytes: int) -> bytes:
    seed = key.encode() or b"\0"
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def address(block: HostBlock) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(block.buf))


def test_a_miss_fills_the_entry_once_and_later_calls_are_hits_on_the_same_bytes(tiers):
    tier, filler = tiers(), Filler()
    first = tier.get_or_fill("ckpt-a", 5000, filler("ckpt-a"))
    second = tier.get_or_fill("ckpt-a", 5000, filler("ckpt-a"))
    assert (first.hit, first.cached, second.hit, second.cached) == (False, True, True, True)
    assert filler.calls == [5000]
    assert bytes(first.buf) == bytes(second.buf) == pattern("ckpt-a", 5000)
    assert len(second.buf) == 5000 and address(first) % PAGE == 0 and address(second) % PAGE == 0
    assert tier.contains("ckpt-a") and not tier.contains("ckpt-b")
    first.close()
    second.close()
    # Another HostTier object of the same name (as another executor would open) hits too.
    other = tiers()
    with other.get_or_fill("ckpt-a", 5000, filler("ckpt-a")) as third:
        assert third.hit and bytes(third.buf) == pattern("ckpt-a", 5000)
    assert filler.calls == [5000]


def test_writes_to_a_block_stay_private_and_read_blocks_are_read_only(tiers):
    tier, filler = tiers(), Filler()
    with tier.get_or_fill("k", PAGE, filler("k")) as written:
        written.buf[:4] = b"XXXX"  # copy-on-write: CPU weights may be written in place
        with tier.get_or_fill("k", PAGE, filler("k")) as again:
            assert bytes(again.buf[:4]) == pattern("k", 4)
    reader = tiers(block_access="read")
    with reader.get_or_fill("k", PAGE, filler("k")) as block:
        assert block.buf.readonly and bytes(block.buf) == pattern("k", PAGE)


def test_lru_eviction_keeps_the_budget_evicts_the_least_recently_used_and_counts_evictions(tiers, name):
    tier, filler = tiers(budget=3 * PAGE), Filler()
    for key in ("a", "b", "c"):
        tier.get_or_fill(key, PAGE, filler(key)).close()
    tier.get_or_fill("a", PAGE, filler("a")).close()  # a hit: now b is the least recently used
    tier.get_or_fill("d", PAGE - 1, filler("d")).close()  # counts as a whole page
    assert [tier.contains(k) for k in "abcd"] == [True, False, True, True]
    tier.get_or_fill("e", 2 * PAGE, filler("e")).close()  # evicts c, then a
    assert [tier.contains(k) for k in "abcde"] == [False, False, False, True, True]
    stats = tier.stats()
    assert stats["evictions"] == stats["process_evictions"] == 3
    assert stats["used_bytes"] == 3 * PAGE == stats["budget_bytes"] and stats["entries"] == 2
    assert len(_segments(name)) == 2  # evicted entries' files are unlinked


def test_an_entry_this_process_holds_open_is_not_evicted(tiers):
    tier, filler = tiers(budget=2 * PAGE), Filler()
    held = tier.get_or_fill("held", PAGE, filler("held"))
    tier.get_or_fill("free", PAGE, filler("free")).close()
    tier.get_or_fill("new", PAGE, filler("new")).close()  # "held" is older but leased
    assert tier.contains("held") and not tier.contains("free") and tier.contains("new")
    held.close()
    held.close()  # idempotent
    tier.get_or_fill("newer", PAGE, filler("newer")).close()
    assert not tier.contains("held")


def test_an_evicted_entry_stays_valid_for_views_that_outlive_its_lease(tiers, name):
    tier, filler = tiers(budget=PAGE), Filler()
    block = tier.get_or_fill("old", PAGE, filler("old"))
    view = block.buf[:16]  # a tensor over the bytes, say
    block.close()  # the lease ends; the mapping stays while the view exists
    with tier.get_or_fill("new", PAGE, filler("new")):
        assert not tier.contains("old") and len(_segments(name)) == 1
        assert bytes(view) == pattern("old", 16)
    view.release()


def test_an_entry_that_cannot_fit_comes_back_uncached_and_evicts_nothing(tiers):
    tier, filler = tiers(budget=2 * PAGE), Filler()
    too_big = tier.get_or_fill("big", 2 * PAGE + 1, filler("big"))
    assert (too_big.cached, too_big.hit) == (False, False) and address(too_big) % PAGE == 0
    assert bytes(too_big.buf) == pattern("big", 2 * PAGE + 1) and not tier.contains("big")
    held = tier.get_or_fill("held", PAGE, filler("held"))
    tier.get_or_fill("free", PAGE, filler("free")).close()
    # Only "free" is evictable, and evicting it would not make room for two pages: nothing goes.
    squeezed = tier.get_or_fill("two", 2 * PAGE, filler("two"))
    assert not squeezed.cached and tier.contains("free") and tier.contains("held")
    for block in (too_big, held, squeezed):
        block.close()
    assert tier.stats()["uncached"] == 2


def test_tags_are_reported_for_ready_entries_only(tiers):
    tier = tiers()
    seen: list[tuple[set[str], bool]] = []

    def fill(buf: memoryview) -> None:
        seen.append((tier.tags(), tier.contains("m")))  # mid-fill: not ready yet
        buf[:] = b"\1" * len(buf)

    tier.get_or_fill("m", PAGE, fill, tags=["fn|model"]).close()
    assert seen == [(set(), False)]
    tier.get_or_fill("m", PAGE, fill, tags=["other|model"]).close()  # a hit adds its tags
    tier.get_or_fill("n", PAGE, fill, tags=["fn|n"]).close()
    assert tier.tags() == {"fn|model", "other|model", "fn|n"}


def test_a_failing_fill_removes_the_entry_and_its_error_propagates(tiers, name):
    tier, filler = tiers(), Filler()

    def broken(buf: memoryview) -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        tier.get_or_fill("k", PAGE, broken)
    assert not tier.contains("k") and not _segments(name) and tier.stats()["entries"] == 0
    with tier.get_or_fill("k", PAGE, filler("k")) as block:
        assert not block.hit and bytes(block.buf) == pattern("k", PAGE)


def test_stats_count_hits_misses_and_bytes_box_wide_and_per_process(tiers):
    one, two, filler = tiers(), tiers(), Filler()
    one.get_or_fill("k", 3000, filler("k")).close()
    two.get_or_fill("k", 3000, filler("k")).close()
    two.get_or_fill("k", 3000, filler("k")).close()
    stats = two.stats()
    assert {k: stats[k] for k in ("hits", "misses", "fills", "bytes_filled", "bytes_served")} == {
        "hits": 2,
        "misses": 1,
        "fills": 1,
        "bytes_filled": 3000,
        "bytes_served": 6000,
    }
    assert (stats["process_hits"], stats["process_misses"], stats["process_bytes_served"]) == (2, 0, 6000)
    assert one.stats()["process_misses"] == 1 and stats["used_bytes"] == PAGE


def test_bad_input_is_refused_with_the_value_named(tiers):
    tier, filler = tiers(), Filler()
    for bad_name in ("", "a/b", "a.b", "x" * 101):
        with pytest.raises(ValueError, match="tier name"):
            HostTier(bad_name, PAGE)
    with pytest.raises(ValueError, match="budget_bytes"):
        HostTier("ok", 0)
    for key in ("", "k" * 1025):
        with pytest.raises(ValueError, match="key"):
            tier.get_or_fill(key, PAGE, filler("k"))
    for nbytes in (0, -1, True):
        with pytest.raises(ValueError, match="nbytes"):
            tier.get_or_fill("k", nbytes, filler("k"))
    with pytest.raises(ValueError, match="tags"):
        tier.get_or_fill("k", PAGE, filler("k"), tags=[""])
    tier.get_or_fill("any chars: / \\ | ü", PAGE, filler("k")).close()  # keys are not file names
    with pytest.raises(HostTierError, match="asked for 10") as caught:
        tier.get_or_fill("any chars: / \\ | ü", 10, filler("k"))
    assert isinstance(caught.value, DataPlaneError) and filler.calls == [PAGE]


def test_a_closed_tier_refuses_calls_but_open_blocks_stay_valid_until_closed(tiers, name):
    tier, filler = tiers(), Filler()
    block = tier.get_or_fill("k", PAGE, filler("k"))
    tier.close()
    tier.close()
    with pytest.raises(HostTierError, match="closed"):
        tier.get_or_fill("k", PAGE, filler("k"))
    assert bytes(block.buf[:1]) == pattern("k", 1)
    assert len([f for f in _files(name) if ".owner-" in f]) == 1  # still leasing
    block.close()
    assert not [f for f in _files(name) if ".owner-" in f]


def test_destroy_removes_every_file_of_the_tier_and_no_other(tiers, name):
    tier, filler = tiers(), Filler()
    neighbour = f"{name}x"
    try:
        with HostTier(neighbour, PAGE) as other:
            other.get_or_fill("k", PAGE, filler("k")).close()
        tier.get_or_fill("k", PAGE, filler("k")).close()
        tier.close()
        HostTier.destroy(name)
        assert not _files(name) and _segments(neighbour)
    finally:
        HostTier.destroy(neighbour)
    assert not os.path.exists(f"/dev/shm/t2i-hosttier-{neighbour}.index")


def test_a_caller_tired_of_waiting_for_another_fill_reads_an_uncached_copy_itself(tiers):
    slow, impatient, filler = tiers(), tiers(wait_timeout_s=0.05), Filler()
    started, gate = threading.Event(), threading.Event()

    def stuck(buf: memoryview) -> None:
        started.set()
        assert gate.wait(BOUND)
        buf[:] = pattern("k", len(buf))

    thread = threading.Thread(target=lambda: slow.get_or_fill("k", PAGE, stuck).close())
    thread.start()
    try:
        assert started.wait(BOUND)
        with impatient.get_or_fill("k", PAGE, filler("k")) as block:
            assert not block.cached and bytes(block.buf) == pattern("k", PAGE)
        assert impatient.stats()["process_waits"] == 1 and filler.calls == [PAGE]
    finally:
        gate.set()
        thread.join(BOUND)
    assert slow.contains("k")
