"""Arenas: thread-safe buddy allocation over heap or shared memory, waiting when full."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.dataplane.arena import Arena, HeapArena, Segment, ShmArena, segment_exists, segment_name
from libs.dataplane.errors import ArenaClosedError, ArenaFullError, DataPlaneError

KIB = 1024
BOUND = 30.0  # generous upper bound on waits that should end almost at once


def _shm_names(prefix: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(prefix + "*"))


@pytest.fixture
def namespace() -> Iterator[str]:
    """A namespace unique to this test; fails the test if it leaves segments behind (and removes them)."""
    ns = f"test{uuid.uuid4().hex[:8]}"
    yield ns
    leftovers = _shm_names(f"t2i-{ns}-")
    for name in leftovers:
        os.unlink(f"/dev/shm/{name}")
    assert not leftovers, f"segments left behind: {leftovers}"


@pytest.fixture(params=["heap", "shm"])
def arena(request: pytest.FixtureRequest, namespace: str) -> Iterator[Arena]:
    if request.param == "heap":
        made: Arena = HeapArena(16 * KIB)
    else:
        made = ShmArena(segment_name(namespace, "arena"), 16 * KIB)
    try:
        yield made
    finally:
        made.close()


def _fill(arena: Arena) -> int:
    offset = arena.allocate(arena.capacity)
    assert arena.free_bytes == 0
    return offset


def test_allocate_waits_and_succeeds_when_another_thread_frees(arena: Arena) -> None:
    held = _fill(arena)
    result: list[int | BaseException] = []

    def allocate() -> None:
        try:
            result.append(arena.allocate(4 * KIB, timeout=BOUND))
        except BaseException as exc:  # surfaced by the assertion below  # noqa: BLE001 - reported to the test, which asserts on it
            result.append(exc)

    waiter = threading.Thread(target=allocate)
    waiter.start()
    assert arena.wait_for_waiters(1, timeout=BOUND), "allocation never started waiting"
    assert not result, "allocation returned although the arena is full"
    arena.free(held)
    waiter.join(timeout=BOUND)
    assert not waiter.is_alive()
    assert len(result) == 1 and isinstance(result[0], int)
    assert arena.block_size(result[0]) == 4 * KIB
    assert arena.waiting == 0


def test_allocate_times_out_with_arena_full_when_nobody_frees(arena: Arena) -> None:
    _fill(arena)
    with pytest.raises(ArenaFullError) as caught:
        arena.allocate(1 * KIB, timeout=0.05)
    assert caught.value.retryable
    assert caught.value.free == 0
    assert arena.waiting == 0


def test_allocate_without_timeout_fails_at_once_when_full(arena: Arena) -> None:
    _fill(arena)
    with pytest.raises(ArenaFullError):
        arena.allocate(1 * KIB)


@pytest.mark.timeout(10)
def test_a_request_larger_than_the_arena_fails_at_once_even_with_a_timeout(arena: Arena) -> None:
    with pytest.raises(ArenaFullError) as caught:
        arena.allocate(arena.capacity + 1, timeout=600)
    assert not caught.value.retryable


def test_closing_the_arena_wakes_waiters_with_arena_closed(arena: Arena) -> None:
    _fill(arena)
    errors: list[BaseException] = []

    def allocate() -> None:
        try:
            arena.allocate(1 * KIB, timeout=BOUND)
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which asserts on it
            errors.append(exc)

    waiter = threading.Thread(target=allocate)
    waiter.start()
    assert arena.wait_for_waiters(1, timeout=BOUND)
    arena.close()
    waiter.join(timeout=BOUND)
    assert len(errors) == 1 and isinstance(errors[0], ArenaClosedError)
    with pytest.raises(ArenaClosedError):
        arena.allocate(1)
    arena.close()  # idempotent


def test_views_write_through_to_the_arena_and_are_bounds_checked(arena: Arena) -> None:
    offset = arena.allocate(1 * KIB)
    arena.view(offset, 4)[:] = b"abcd"
    assert bytes(arena.buf[offset : offset + 4]) == b"abcd"
    with pytest.raises(ValueError):
        arena.view(arena.capacity - 8, 16)
    with pytest.raises(ValueError):
        arena.view(-1, 4)


def test_freeing_an_unallocated_offset_raises(arena: Arena) -> None:
    offset = arena.allocate(256)
    arena.free(offset)
    with pytest.raises(ValueError):
        arena.free(offset)


def test_stats_are_one_consistent_snapshot(arena: Arena) -> None:
    arena.allocate(1 * KIB)
    arena.allocate(100)
    assert arena.stats() == {
        "capacity": 16 * KIB,
        "used": 1 * KIB + 256,
        "free": 15 * KIB - 256,
        "largest_free": 8 * KIB,
        "blocks": 2,
    }


def test_shm_arena_replaces_a_stale_segment_and_unlinks_its_own_on_close(namespace: str) -> None:
    name = segment_name(namespace, "exec")
    # A crashed executor leaves its segment behind; its successor must start clean.
    Path(f"/dev/shm/{name}").write_bytes(b"old!" * KIB)
    fresh = ShmArena(name, 8 * KIB)
    try:
        assert bytes(fresh.buf[:4]) == b"\0\0\0\0"
        assert Segment(name).size == 8 * KIB
    finally:
        fresh.close()
    assert not segment_exists(name)


def test_closing_an_shm_arena_while_a_view_is_alive_unlinks_it_without_error(namespace: str) -> None:
    name = segment_name(namespace, "exec")
    arena = ShmArena(name, 4 * KIB)
    offset = arena.allocate(256)
    survivor = arena.view(offset, 256)
    survivor[:3] = b"hey"
    arena.close()
    assert not segment_exists(name)
    assert bytes(survivor[:3]) == b"hey"  # the mapping lives as long as its last view


def test_peer_segments_are_mapped_read_only(namespace: str) -> None:
    name = segment_name(namespace, "exec")
    with ShmArena(name, 4 * KIB) as arena:
        arena.buf[:2] = b"hi"
        peer = Segment(name)
        try:
            assert bytes(peer.view[:2]) == b"hi"
            with pytest.raises(TypeError):
                peer.view[:2] = b"no"
        finally:
            peer.close()


def test_attaching_to_a_missing_segment_is_a_clear_error(namespace: str) -> None:
    with pytest.raises(DataPlaneError, match="does not exist"):
        ShmArena(segment_name(namespace, "ghost"), 4 * KIB, create=False)


@pytest.mark.parametrize(("namespace_part", "executor"), [("a/b", "x"), ("ns", ""), ("ns", "bad name")])
def test_segment_names_reject_characters_shm_open_cannot_take(namespace_part: str, executor: str) -> None:
    with pytest.raises(ValueError):
        segment_name(namespace_part, executor)


def test_a_free_from_a_finalizer_inside_the_arenas_own_lock_is_deferred_not_deadlocked(arena: Arena) -> None:
    # Cyclic GC can run a lease's finalizer while this very thread is inside an arena operation.
    offset = arena.allocate(1 * KIB)
    with arena._locked():
        arena.free_soon(offset)
        assert arena._alloc.used_bytes == 1 * KIB  # not freed mid-operation...
    assert arena.used_bytes == 0  # ...but as the operation ends


def test_a_free_from_another_thread_frees_at_once(arena: Arena) -> None:
    offset = arena.allocate(1 * KIB)
    freer = threading.Thread(target=arena.free_soon, args=(offset,))
    freer.start()
    freer.join(timeout=BOUND)
    assert arena.used_bytes == 0


def test_the_data_plane_package_and_its_metadata_import_without_torch() -> None:
    # The gateway and scheduler import these; torch must stay out of their processes.
    code = (
        "import sys, libs.dataplane, libs.protocol.tensor_meta, libs.dataplane.transport.nvshmem; "
        "sys.exit('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], timeout=BOUND
    )
    assert done.returncode == 0, "importing libs.dataplane imported torch"
