"""Deployment modes in the scheduler core (docs/scheduling.md, "Deployment modes (baselines)"):
under NoCache, WCache and MCache each request runs whole on one executor, held exclusively, bound
by the mode's affinity; ``ours`` dispatches node by node. Hand-built events, no broker."""

from __future__ import annotations

import pytest

from libs.protocol.ids import ModelKey
from libs.protocol.messages import ExecutorHeartbeat
from services.scheduler.core.deployment import MODES, Deployment
from services.scheduler.core.effects import Finished
from services.scheduler.core.policy import fifo, get_policy
from services.scheduler.core.scheduling import SchedulerCore
from tests.unit.test_scheduler_core import FNS, complete, dispatches, request, toy_dag


def beat(ex: str, cached: dict[ModelKey, int] | None = None, seq: int = 1) -> ExecutorHeartbeat:
    """A heartbeat of ``ex`` with ``cached`` models (model -> bytes) wholly on its device."""
    entries = {k.encode(): [4, 4, n, n] for k, n in (cached or {}).items()}
    return ExecutorHeartbeat(ex, "cpu", "shm", f"seg-{ex}", FNS, cached=entries, seq=seq)


def core_with(mode: str, executors: list[str], policy=fifo) -> SchedulerCore:
    core = SchedulerCore(policy, deployment=Deployment(mode))
    for ex in executors:
        core.on_heartbeat(beat(ex), 0.0)
    return core


def run_all(core: SchedulerCore, order: str = "fifo") -> tuple[list[tuple[str, str]], list[Finished]]:
    """Complete dispatches one at a time (``order``: oldest first, or newest first to interleave
    the requests), checking that no executor runs nodes of two requests while both are in progress.
    Returns (request, executor) per dispatch, in order, and the results."""
    log: list[tuple[str, str]] = []
    finished: list[Finished] = []
    holder: dict[str, str] = {}  # executor -> the request whose nodes it ran, while in progress
    pending: list = []

    def take(new: list) -> None:
        for d in new:
            rid = d.msg.request_id
            if core.deployment.monolithic:
                assert holder.setdefault(d.executor, rid) == rid, f"{d.executor} interleaved requests"
            log.append((rid, d.executor))
        pending.extend(new)

    take(dispatches(core.schedule(0.0)))
    while pending:
        d = pending.pop(0 if order == "fifo" else -1)
        done = [e for e in core.on_complete(complete(d), 0.0) if isinstance(e, Finished)]
        for f in done:
            holder = {ex: r for ex, r in holder.items() if r != f.result.request_id}
        finished += done
        take(dispatches(core.schedule(0.0)))
    return log, finished


def executors_per_request(log: list[tuple[str, str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for rid, ex in log:
        out.setdefault(rid, set()).add(ex)
    return out


@pytest.mark.parametrize("mode", ["nocache", "wcache", "mcache"])
@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_each_request_runs_whole_on_one_executor_held_exclusively(mode: str, order: str) -> None:
    core = core_with(mode, ["e1", "e2", "e3"])
    dag = toy_dag(steps=3)
    for i in range(4):
        core.add_request(request(f"r{i}", tenant=f"t{i % 2}"), dag, attempt=1, now=0.0)
    log, finished = run_all(core, order)
    assert sorted(f.result.request_id for f in finished) == ["r0", "r1", "r2", "r3"]
    assert all(f.result.status == "succeeded" for f in finished)
    per = executors_per_request(log)
    assert all(len(exs) == 1 for exs in per.values()), per
    assert all(f.result.executors == sorted(per[f.result.request_id]) for f in finished)
    core.deployment.sync(core.runs, core.executors)  # (done lazily, before each placement)
    assert not core.deployment.bound and not core.deployment.holder  # all freed at the end


def test_ours_spreads_a_request_over_executors_and_baselines_do_not() -> None:
    dag = toy_dag(steps=2)
    ours = core_with("ours", ["e1", "e2"])
    ours.add_request(request(), dag, attempt=1, now=0.0)
    assert {d.executor for d in dispatches(ours.schedule(0.0))} == {"e1", "e2"}  # both roots at once
    mono = core_with("nocache", ["e1", "e2"])
    mono.add_request(request(), dag, attempt=1, now=0.0)
    first = dispatches(mono.schedule(0.0))
    assert len(first) == 1  # one GPU function: its roots run one after the other there
    mono.on_complete(complete(first[0]), 0.0)
    (second,) = dispatches(mono.schedule(0.0))
    assert second.executor == first[0].executor and second.msg.node_id != first[0].msg.node_id


def test_a_request_waits_for_a_held_executor_and_others_take_free_ones() -> None:
    core = core_with("nocache", ["e1"])
    dag = toy_dag(steps=2)
    core.add_request(request("r1"), dag, attempt=1, now=0.0)
    core.add_request(request("r2"), dag, attempt=1, now=0.0)
    log, finished = run_all(core)
    rids = [rid for rid, _ in log]
    assert rids == sorted(rids)  # every node of r1 before any of r2: e1 was held
    assert [f.result.request_id for f in finished] == ["r1", "r2"]
    # a new executor joining while r1 holds e1 takes r2 at once
    core = core_with("nocache", ["e1"])
    core.add_request(request("r1"), dag, attempt=1, now=0.0)
    core.add_request(request("r2"), dag, attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    assert d.msg.request_id == "r1"
    core.on_heartbeat(beat("e2"), 0.0)
    (d2,) = dispatches(core.schedule(0.0))
    assert (d2.msg.request_id, d2.executor) == ("r2", "e2")


def test_dispatch_carries_the_workflow() -> None:
    core = core_with("wcache", ["e1"])
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    assert d.msg.workflow == "toy"


def models_of(dag) -> list[ModelKey]:
    return sorted({ModelKey(n.fn, n.model) for n in dag.nodes.values()}, key=ModelKey.encode)


def test_wcache_binds_to_the_executor_with_the_workflow_cached() -> None:
    dag = toy_dag()
    models = models_of(dag)
    core = core_with("wcache", [])
    core.on_heartbeat(beat("e1"), 0.0)  # empty
    core.on_heartbeat(beat("e2", {m: 100 for m in models[:-1]}), 0.0)  # most of it: not cached
    core.on_heartbeat(beat("e3", {m: 100 for m in models}), 0.0)  # the whole workflow
    core.add_request(request(), dag, attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    assert d.executor == "e3"
    # with it cached nowhere: the executor with the least cached (the least to evict)
    core = core_with("wcache", [])
    core.on_heartbeat(beat("e1", {ModelKey("x.fn", "big"): 10_000}), 0.0)
    core.on_heartbeat(beat("e2", {models[0]: 100}), 0.0)
    core.add_request(request(), dag, attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    assert d.executor == "e2"


def test_mcache_binds_to_the_executor_with_most_of_the_requests_model_bytes() -> None:
    dag = toy_dag()
    models = models_of(dag)
    core = core_with("mcache", [])
    core.on_heartbeat(beat("e1", {models[0]: 100}), 0.0)
    core.on_heartbeat(beat("e2", {models[1]: 5_000}), 0.0)
    core.on_heartbeat(beat("e3", {ModelKey("x.fn", "other"): 50_000}), 0.0)
    core.add_request(request(), dag, attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    assert d.executor == "e2"


def test_nocache_binds_to_the_least_loaded_executor() -> None:
    core = core_with("nocache", ["e1", "e2"])
    core.add_request(request("r1"), toy_dag(), attempt=1, now=0.0)
    run_all(core)  # e1 ran r1: it is the busier one now
    core.add_request(request("r2"), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    assert d.executor == "e2"


def test_a_request_whose_executor_is_lost_finishes_on_another() -> None:
    core = core_with("mcache", ["e1", "e2"])
    core.add_request(request(), toy_dag(steps=3), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.on_complete(complete(d), 0.0)
    (d,) = dispatches(core.schedule(0.0))
    lost = d.executor
    core.remove_executor(lost, 1.0, "test")
    log, finished = run_all(core)
    assert {ex for _, ex in log} == {"e1", "e2"} - {lost}
    (f,) = finished
    assert f.result.status == "succeeded"


def test_the_policy_still_orders_requests_and_charges_vtime() -> None:
    core = core_with("nocache", ["e1"], policy=get_policy("fair", 0.0))
    dag = toy_dag(steps=2)
    core.add_request(request("a1", tenant="a"), dag, attempt=1, now=0.0)
    core.add_request(request("a2", tenant="a"), dag, attempt=1, now=0.0)
    core.add_request(request("b1", tenant="b"), dag, attempt=2, now=0.5)
    log, _ = run_all(core)
    order = [rid for i, (rid, _) in enumerate(log) if i == 0 or log[i - 1][0] != rid]
    assert order == ["a1", "b1", "a2"]  # fair: b (less served) before a's second request
    assert core.accounts["a"].vtime > 0 and core.accounts["b"].vtime > 0


def test_unknown_modes_are_refused() -> None:
    assert MODES == ("ours", "nocache", "wcache", "mcache")
    with pytest.raises(ValueError, match="deployment mode"):
        Deployment("monolith")
