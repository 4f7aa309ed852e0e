"""The layer cache shared by real and simulated executors (paper §5.1, §5.3): the prefix arithmetic
of :mod:`libs.dataplane.weights.prefix` and the residency policy of
:mod:`libs.dataplane.weights.policy`."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.dataplane.weights import (
    ARENA,
    DEVICE,
    CachePolicy,
    Eviction,
    NoRoom,
    pipelined_seconds,
    prefix_length,
    sequential_seconds,
    uniform_prefix,
)
from libs.dataplane.weights.prefix import EPSILON

FEW = settings(max_examples=60, deadline=None)
times = st.floats(min_value=1e-4, max_value=10.0, allow_nan=False, allow_infinity=False)
layer_times = st.lists(st.tuples(times, times), min_size=1, max_size=24)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def eq1(layers: int, t_load: float, t_comp: float, resident: int) -> float:
    return max(layers * t_comp, (layers - resident) * t_load + t_comp)


# -- prefix arithmetic ---------------------------------------------------------------------------
@FEW
@given(st.integers(1, 64), times, times, st.data())
def test_a_uniform_pipeline_takes_eq1(layers: int, t_load: float, t_comp: float, data) -> None:
    resident = data.draw(st.integers(1, layers))
    load, comp = [t_load] * layers, [t_comp] * layers
    assert close(pipelined_seconds(load, comp, resident), eq1(layers, t_load, t_comp, resident))


@FEW
@given(st.integers(1, 64), times, times)
def test_with_nothing_resident_the_first_layers_load_is_exposed(layers, t_load, t_comp) -> None:
    """Eq. 1 at Lₑ = 0 omits the first layer's load, which nothing can hide: it only holds when
    loading is at least as slow as computing."""
    got = pipelined_seconds([t_load] * layers, [t_comp] * layers, 0)
    assert close(got, max(t_load + layers * t_comp, layers * t_load + t_comp))
    if t_load >= t_comp:
        assert close(got, eq1(layers, t_load, t_comp, 0))


@FEW
@given(st.integers(1, 64), st.integers(1, 1000), st.integers(1, 1000))
def test_the_uniform_prefix_is_eq2_in_exact_arithmetic(layers, ms_load, ms_comp) -> None:
    """Whole milliseconds keep every sum exact, so neither side rounds at a boundary. The one layer
    Eq. 2 leaves out (it derives from Eq. 1) is the first when loading is much faster than
    computing: Eq. 2 says 0, but layer 0's load would still delay the forward."""
    load, comp = [float(ms_load)] * layers, [float(ms_comp)] * layers
    assert prefix_length(load, comp) == max(1, uniform_prefix(layers, ms_load, ms_comp))


@FEW
@given(st.integers(1, 64), times, times)
def test_the_uniform_prefix_is_eq2_away_from_whole_layers(layers, t_load, t_comp) -> None:
    exact = (layers * t_load - layers * t_comp + t_comp) / t_load
    if abs(exact - round(exact)) < 1e-6:
        return  # at a whole number of layers either rounding is right
    expected = max(1, uniform_prefix(layers, t_load, t_comp))
    assert prefix_length([t_load] * layers, [t_comp] * layers) == expected


@FEW
@given(layer_times)
def test_the_prefix_is_the_smallest_without_a_slowdown(pairs) -> None:
    load, comp = [p[0] for p in pairs], [p[1] for p in pairs]
    total = sum(comp)
    slack = EPSILON * max(total, 1e-12)
    brute = next(k for k in range(len(load) + 1) if pipelined_seconds(load, comp, k) <= total + slack)
    assert prefix_length(load, comp) == brute
    assert pipelined_seconds(load, comp, len(load)) == pytest.approx(total)


@FEW
@given(layer_times)
def test_more_resident_layers_never_slow_a_forward_and_pipelining_never_loses(pairs) -> None:
    load, comp = [p[0] for p in pairs], [p[1] for p in pairs]
    ends = [pipelined_seconds(load, comp, k) for k in range(len(load) + 1)]
    for k in range(len(load)):
        assert ends[k + 1] <= ends[k] * (1 + 1e-9)
        assert sequential_seconds(load, comp, k) >= ends[k] * (1 - 1e-9)
        assert ends[k] >= sum(comp) * (1 - 1e-9)


# -- the policy ----------------------------------------------------------------------------------
def run(policy: CachePolicy, key: str, evicted: list[Eviction], arena: bool = False) -> list:
    """Acquire ``key`` as an executor would (evictions recorded), and unpin it after its node."""
    placements = policy.acquire(key, evict=evicted.append, try_arena=(lambda _l, _n: arena))
    policy.unpin(key)
    return placements


def order(evictions: list[Eviction]) -> list[tuple[str, int]]:
    return [(e.key, e.layer) for e in evictions]


def test_evictions_go_lru_model_first_top_layer_first_down_to_keep_then_prefixes() -> None:
    p = CachePolicy(device_budget=80)  # two models of 40
    for key in "ABC":
        p.add(key, [10] * 4, keep=2)
    p.add("D", [10] * 6, keep=3)
    evicted: list[Eviction] = []
    run(p, "A", evicted)
    run(p, "B", evicted)
    assert evicted == []
    run(p, "C", evicted)  # phase 1: A down to its keep, then B down to its keep
    assert order(evicted) == [("A", 3), ("A", 2), ("B", 3), ("B", 2)]
    assert all(e.region == DEVICE and e.nbytes == 10 for e in evicted)
    evicted.clear()
    run(p, "D", evicted)  # phase 1: C (the only one above its keep), phase 2: A's then B's prefix
    assert order(evicted) == [("C", 3), ("C", 2), ("A", 1), ("A", 0), ("B", 1), ("B", 0)]
    assert p.snapshot() == {"C": (2, 4, 20, 40), "D": (6, 6, 60, 60)}
    assert p.used == {DEVICE: 80, ARENA: 0}
    evicted.clear()
    assert run(p, "C", evicted) == [(2, DEVICE), (3, DEVICE)]  # reloads its top; D is now the LRU
    assert order(evicted) == [("D", 5), ("D", 4)]
    assert p.keys() == ["A", "B", "D", "C"]


def test_a_pinned_model_keeps_every_layer_and_the_newcomer_runs_over_then_is_trimmed() -> None:
    p = CachePolicy(device_budget=80)
    p.add("A", [10] * 6)
    p.add("B", [10] * 4, keep=1)
    p.add("C", [10] * 2)
    evicted: list[Eviction] = []
    run(p, "C", evicted)
    p.acquire("A", evict=evicted.append)  # A is executing
    assert evicted == []
    placements = p.acquire("B", evict=evicted.append)  # only C's 20 bytes can go
    assert placements == [(i, DEVICE) for i in range(4)]
    assert order(evicted) == [("C", 1), ("C", 0)]
    assert p.resident("A") == 6 and p.resident("B") == 4
    assert p.used[DEVICE] == 100  # over the budget while A and B both execute
    p.unpin("B")
    trimmed = p.over_budget()
    assert order(trimmed) == [("B", 3), ("B", 2)]  # A, still pinned, is never a victim
    assert p.used[DEVICE] == 80 and p.resident("A") == 6
    p.unpin("A")
    assert p.over_budget() == []


def test_make_room_that_cannot_succeed_evicts_nothing() -> None:
    p = CachePolicy(device_budget=50)
    p.add("A", [10] * 4)
    p.add("B", [10])
    run(p, "B", [])
    p.acquire("A", evict=lambda e: pytest.fail(f"evicted {e}"))
    with pytest.raises(NoRoom) as e:
        p.make_room(DEVICE, 30)
    assert e.value.region == DEVICE and e.value.nbytes == 30
    assert p.snapshot() == {"B": (1, 1, 10, 10), "A": (4, 4, 40, 40)}
    assert order(p.make_room(DEVICE, 10)) == [("B", 0)]


@pytest.mark.timeout(10)
def test_reclaiming_the_arena_evicts_only_models_holding_arena_bytes_and_counts_only_those() -> None:
    p = CachePolicy(device_budget=40, arena_budget=40)
    p.add("A", [10] * 4)  # all on the device
    p.add("B", [10] * 4)  # all in the arena
    run(p, "A", [])
    assert run(p, "B", [], arena=True) == [(i, ARENA) for i in range(4)]
    assert p.used == {DEVICE: 40, ARENA: 40}
    reclaimed = p.reclaim(ARENA, 15)
    assert order(reclaimed) == [("B", 3), ("B", 2)]
    assert all(e.region == ARENA for e in reclaimed)
    assert p.resident("A") == 4 and p.used == {DEVICE: 40, ARENA: 20}
    p.pin("B")
    assert p.reclaim(ARENA, 15) == []  # never a pinned model, never an error
    p.unpin("B")
    assert order(p.reclaim(ARENA, 1000)) == [("B", 1), ("B", 0)]
    assert p.reclaim(ARENA, 10) == [] and p.resident("A") == 4


@pytest.mark.timeout(10)
def test_reclaim_evicts_device_layers_above_arena_ones_without_counting_them() -> None:
    p = CachePolicy(device_budget=10, arena_budget=10)
    p.add("X", [10])
    p.add("M", [10, 10])
    run(p, "X", [])
    evicted: list[Eviction] = []
    # layer 0 goes to the arena (the device is full), layer 1 to the device after evicting X
    assert run(p, "M", evicted, arena=True) == [(0, ARENA), (1, DEVICE)]
    assert order(evicted) == [("X", 0)]
    reclaimed = p.reclaim(ARENA, 5)  # M's top layer (device) must go first to keep a prefix
    assert [(e.layer, e.region) for e in reclaimed] == [(1, DEVICE), (0, ARENA)]
    assert p.used == {DEVICE: 0, ARENA: 0}


ops = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("unpin"), st.integers(0, 3)),
        st.tuples(st.just("reclaim"), st.integers(0, 200)),
        st.tuples(st.just("shrink"), st.integers(0, 3), st.integers(0, 8)),
        st.tuples(
            st.just("over_budget"),
        ),
    ),
    max_size=40,
)
models = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=8), min_size=4, max_size=4)


@pytest.mark.timeout(30)
@settings(max_examples=80, deadline=None)
@given(models, st.integers(0, 200), st.integers(0, 100), ops, st.data())
def test_residency_is_always_a_prefix_and_the_books_balance(sizes, device, arena, steps, data) -> None:
    p = CachePolicy(device, arena)
    for i, s in enumerate(sizes):
        p.add(i, s, keep=data.draw(st.integers(0, len(s))))
    in_arena: set[tuple[int, int]] = set()  # what the caller allocated in the arena
    pins = [0] * len(sizes)

    def evict(e: Eviction) -> None:
        assert not p.pinned(e.key)
        assert e.layer >= p.resident(e.key)  # already evicted, from the top
        if e.region == ARENA:
            in_arena.remove((e.key, e.layer))

    def try_arena(key: int):
        def alloc(layer: int, nbytes: int) -> bool:
            ok = data.draw(st.booleans())
            if ok:
                in_arena.add((key, layer))
            return ok

        return alloc

    for step in steps:
        before = [p.resident(k) for k in range(len(sizes))]
        if step[0] == "acquire":
            _, k, _ = step
            for layer, region in p.acquire(k, evict=evict, try_arena=try_arena(k)):
                assert region in (DEVICE, ARENA) and layer < len(sizes[k])
            pins[k] += 1
            assert p.resident(k) == len(sizes[k])
        elif step[0] == "unpin" and pins[step[1]]:
            p.unpin(step[1])
            pins[step[1]] -= 1
        elif step[0] == "reclaim":
            for e in p.reclaim(ARENA, step[1]):
                evict(e)
        elif step[0] == "shrink" and not pins[step[1]]:
            for e in p.shrink(step[1], step[2]):
                evict(e)
        elif step[0] == "over_budget":
            for e in p.over_budget():
                evict(e)
            if not any(pins):
                assert p.used[DEVICE] <= p.budgets[DEVICE]
        used = {DEVICE: 0, ARENA: 0}
        for k, s in enumerate(sizes):
            n = p.resident(k)
            regions = [p.region(k, layer) for layer in range(len(s))]
            assert None not in regions[:n] and regions[n:] == [None] * (len(s) - n)
            for layer in range(n):
                used[regions[layer]] += s[layer]
            if pins[k]:
                assert n >= before[k]  # a pinned model never loses a layer
        assert p.used == used
        assert in_arena == {
            (k, i) for k in range(len(sizes)) for i in range(p.resident(k)) if p.region(k, i) == ARENA
        }
        assert p.used[ARENA] <= p.budgets[ARENA]
