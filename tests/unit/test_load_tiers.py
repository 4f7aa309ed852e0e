"""Loads from the box's host tier are estimated, charged and placed apart from loads from disk."""

from __future__ import annotations

import msgspec

from libs.protocol.ids import ModelKey, NodeRef
from libs.protocol.messages import NodeTiming
from services.scheduler.core.estimates import Estimator
from services.scheduler.core.policy import fifo
from services.scheduler.core.scheduling import SchedulerCore
from services.scheduler.core.snapshot import ExecutorInfo, ReadyNode, best_fit, charge_for
from tests.unit.test_scheduler_core import complete, dispatches, hb, request, toy_dag

KEY = ModelKey("f.a", "m")


def node(est: float = 1.0, disk: float = 2.0, host: float = 0.25) -> ReadyNode:
    return ReadyNode(NodeRef("r1", 1, "x"), "t", "f.a", "m", 0, 0.0, 0.0, (), est, disk, 1.0, 1.0, host)


def executor(eid: str, resident=(), host=()) -> ExecutorInfo:
    return ExecutorInfo(eid, frozenset({"f.a"}), frozenset(resident), host_resident=frozenset(host))


def test_the_estimator_learns_disk_and_host_loads_separately():
    est = Estimator()
    est.observe("f.a", "m", "", "cpu", run_s=1.0, load_s=2.0, load_tier="disk")
    assert est.load_estimate("f.a", "m", "cpu", tier="host") == 2.0  # no host load seen yet: as disk
    est.observe("f.a", "m", "", "cpu", run_s=1.0, load_s=0.25, load_tier="host")
    assert est.load_estimate("f.a", "m", "cpu", tier="host") == 0.25
    assert est.load_estimate("f.a", "m", "cpu") == 2.0
    assert est.load_estimate("f.a", "m", "cuda", tier="host") == 0.25  # any kind, same tier


def test_the_charge_at_dispatch_counts_the_load_the_chosen_executor_would_do():
    n = node()
    assert charge_for(n, executor("warm", resident=[KEY])) == 1.0
    assert charge_for(n, executor("host", host=[KEY])) == 1.25
    assert charge_for(n, executor("cold")) == 3.0


def test_placement_prefers_a_resident_model_then_one_in_the_host_tier():
    n = node()
    cold, host, warm = executor("a-cold"), executor("b-host", host=[KEY]), executor("c-warm", resident=[KEY])
    assert best_fit(n, [cold, host, warm]).id == "c-warm"
    assert best_fit(n, [cold, host]).id == "b-host"
    assert best_fit(n, [cold]).id == "a-cold"


def test_heartbeats_report_the_host_tier_and_completions_train_the_estimate_of_their_tier():
    core = SchedulerCore(fifo)
    beat = hb("e1")
    beat.host_resident.append("f.a|m")
    beat.host_resident.append("not-a-model-key")  # malformed: ignored, never fatal
    core.on_heartbeat(beat, 0.0)
    assert core.executors["e1"].host_resident == frozenset({ModelKey("f.a", "m")})
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    first = dispatches(core.schedule(0.0))[0]
    done = msgspec.structs.replace(
        complete(first), timing=NodeTiming(load_s=0.3, exec_s=0.5, load_tier="host")
    )
    core.on_complete(done, 1.0)
    fn, model = first.msg.fn, first.msg.model
    assert core.estimator.load_estimate(fn, model, "cpu", tier="host") == 0.3
    assert core.estimator.load_estimate(fn, model, "cpu", tier="disk") == 0.0  # no disk load seen
