"""Cache granularities of the deployment modes (docs/scheduling.md, "Deployment modes"), at the level
of the shared :class:`~libs.dataplane.weights.CachePolicy`: ServerlessT2I's layer prefixes against
the paper's baselines (§8.1) MCache (whole models), WCache (whole workflows) and NoCache (nothing
kept after a request).

The hand-built case: two workflows share a text encoder ``te`` (40 bytes), each with its own
diffusion model (60 bytes), under a budget of 100 bytes: one workflow fits, not two."""

from __future__ import annotations

import pytest

from libs.dataplane.weights import DEVICE, LAYER, MODEL, NONE, WORKFLOW, CachePolicy

TE, D1, D2 = [10] * 4, [15] * 4, [15] * 4
W1 = {"te": TE, "d1": D1}
W2 = {"te": TE, "d2": D2}


def key(policy: CachePolicy, workflow: str, model: str) -> object:
    """The executors' cache key: per (workflow, model) under WCache (its own copy per workflow)."""
    return (workflow, model) if policy.granularity == WORKFLOW else model


def run_workflow(policy: CachePolicy, name: str, models: dict[str, list[int]], request: str = "") -> int:
    """Run each model of a workflow once, as its nodes would; returns the bytes loaded."""
    policy.begin_request(request or name)
    loaded = 0
    for model, sizes in models.items():
        k = key(policy, name, model)
        if k not in policy:
            policy.add(k, sizes, keep=2, group=name)
        placements = policy.acquire(k, evict=lambda ev: None)
        loaded += sum(sizes[layer] for layer, _ in placements)
        policy.unpin(k)
        policy.over_budget()
    return loaded


def residency(policy: CachePolicy) -> dict[object, int]:
    return {k: policy.resident(k) for k in policy.keys() if policy.resident(k)}


def test_ours_keeps_prefixes_of_what_it_evicts() -> None:
    p = CachePolicy(100, granularity=LAYER)
    assert run_workflow(p, "w1", W1) == 100
    loaded = run_workflow(p, "w2", W2)
    assert loaded == 60  # the shared encoder hits
    res = residency(p)
    assert res["te"] >= 2 and res["d2"] == 4
    assert 0 < res["d1"] < 4  # a prefix of the evicted model stays
    assert p.used[DEVICE] <= 100


def test_mcache_keeps_the_shared_encoder_and_evicts_whole_models() -> None:
    p = CachePolicy(100, granularity=MODEL)
    run_workflow(p, "w1", W1)
    assert run_workflow(p, "w2", W2) == 60  # te is shared across workflows: a hit
    assert residency(p) == {"te": 4, "d2": 4}  # d1 went whole, no prefix left behind
    # back to w1: d1 loads whole again and d2 (least recently used) goes whole
    assert run_workflow(p, "w1", W1) == 60
    assert residency(p) == {"te": 4, "d1": 4}


def test_wcache_evicts_the_least_recently_used_workflow_whole() -> None:
    p = CachePolicy(100, granularity=WORKFLOW)
    run_workflow(p, "w1", W1)
    assert run_workflow(p, "w2", W2) == 100  # its own copy of te: no sharing across workflows
    assert residency(p) == {("w2", "te"): 4, ("w2", "d2"): 4}
    assert run_workflow(p, "w2", W2) == 0  # a cached workflow runs without any load


def test_wcache_keeps_workflows_that_fit_and_never_splits_one() -> None:
    p = CachePolicy(250, granularity=WORKFLOW)
    run_workflow(p, "w1", W1)
    run_workflow(p, "w2", W2)
    assert p.used[DEVICE] == 200  # both fit: both cached, te twice
    w3 = {"d3": [25] * 4}
    run_workflow(p, "w1", W1)  # w1 most recently used: w2 is the victim
    run_workflow(p, "w3", w3)
    assert residency(p) == {("w1", "te"): 4, ("w1", "d1"): 4, ("w3", "d3"): 4}


def test_wcache_never_evicts_a_workflow_with_a_model_in_use() -> None:
    p = CachePolicy(100, granularity=WORKFLOW)
    run_workflow(p, "w1", W1)
    p.pin(("w1", "te"))  # w1's function is running a node
    p.touch(("w1", "d1"))
    p.add(("w2", "d2"), D2, group="w2")
    p.acquire(("w2", "d2"), evict=lambda ev: None)  # no room to make: runs over the budget
    assert p.resident(("w1", "d1")) == 4 and p.resident(("w1", "te")) == 4
    p.unpin(("w2", "d2"))
    p.over_budget()
    assert p.resident(("w2", "d2")) == 0  # the newcomer trimmed back, w1 untouched
    assert p.resident(("w1", "d1")) == 4


def test_nocache_keeps_nothing_after_a_request() -> None:
    p = CachePolicy(1000, granularity=NONE)
    assert run_workflow(p, "w1", W1, request="r1") == 100
    assert p.end_request("r1") and p.used[DEVICE] == 0
    # a lost end-of-request: the next request's first node finds the device empty anyway
    assert run_workflow(p, "w1", W1, request="r2") == 100
    assert run_workflow(p, "w1", W1, request="r3") == 100
    assert p.end_request("r2") == []  # not the request whose models are here: nothing happens
    assert p.used[DEVICE] == 100


def test_nocache_reuses_models_within_a_request() -> None:
    p = CachePolicy(1000, granularity=NONE)
    p.begin_request("r1")
    assert run_workflow(p, "w1", W1, request="r1") == 100
    assert run_workflow(p, "w1", W1, request="r1") == 0  # e.g. the diffusion model once per step


@pytest.mark.parametrize("granularity", [MODEL, WORKFLOW, NONE])
def test_coarse_units_leave_no_partial_residency(granularity: str) -> None:
    p = CachePolicy(100, arena_budget=60, granularity=granularity)
    for i in range(5):
        name = f"w{i}"
        run_workflow(p, name, {f"m{i}": [10] * 5, "shared": [5] * 4}, request=name)
        for k in p.keys():
            assert p.resident(k) in (0, len(p.sizes(k)))
        freed = p.reclaim("arena", 7)
        for k in p.keys():
            assert p.resident(k) in (0, len(p.sizes(k)))
        assert freed == [] or sum(ev.nbytes for ev in freed if ev.region == "arena") >= 7


def test_unknown_granularity_is_refused() -> None:
    with pytest.raises(ValueError, match="granularity"):
        CachePolicy(10, granularity="page")
