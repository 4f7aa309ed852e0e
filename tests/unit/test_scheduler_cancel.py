"""Cancel and progress in the scheduler core (``SchedulerCore.cancel``, ``progress.py``), driven
with hand-built events: what a cancelled request charges, what it tells executors, and how steps
and node events count."""

from __future__ import annotations

import pytest

from libs.protocol.messages import ExecutorHeartbeat, NodeFailed
from libs.sim.workflows import sim_workflow
from libs.workflow.dag import unroll
from libs.workflow.params import resolve_params
from services.scheduler.core import progress
from services.scheduler.core.effects import AppendEvent, ChargeVTime, Finished, ReleaseAttempt, SendCancel
from tests.unit.test_lineage import core_with, on, pipeline_dag, run_on
from tests.unit.test_scheduler_core import complete, request


def test_cancel_mid_run_refunds_the_running_node_and_charges_the_nodes_that_ran():
    core = core_with("e1", "e2")
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e1")  # enc
    run_on(core, "e1")  # cond
    (s0,) = on(core, "e1")  # running when the client cancels
    estimate = core.runs["r1"].nodes["s0"].charge_s
    assert estimate > 0

    effects = core.cancel("r1", "t1")
    assert [e for e in effects if isinstance(e, ChargeVTime)] == [ChargeVTime("t1", delta=-estimate, ops=-1)]
    (cancel,) = [e for e in effects if isinstance(e, SendCancel)]
    assert cancel.executor == "e1" and cancel.msg.ref == s0.msg.ref and not cancel.msg.restart_ok
    assert any(isinstance(e, ReleaseAttempt) for e in effects)  # its tensors are freed
    (f,) = [e for e in effects if isinstance(e, Finished)]
    assert f.result.status == "cancelled" and f.result.error_code == "cancelled"
    assert f.result.nodes_run == 2 and f.result.nodes == 6
    acct = core.accounts["t1"]
    assert f.result.gpu_s == pytest.approx(1.0) == pytest.approx(acct.vtime)  # enc and cond: 0.5 s each
    assert acct.ops == 2 and acct.requests == 0 and not core.runs

    # The executor's answer to the cancel frees it; nothing more is charged or dispatched.
    failed = NodeFailed("e1", "r1", 1, "s0", "cancelled by the scheduler", retryable=True)
    assert core.on_failed(failed, 1.0) == []
    assert core.executors["e1"].idle
    assert core.schedule(1.0) == []
    # A completion that overtook the cancel is not charged either.
    assert not [e for e in core.on_complete(complete(s0), 1.0) if isinstance(e, ChargeVTime)]
    assert acct.vtime == pytest.approx(1.0)


def test_cancelling_an_ended_unknown_or_other_tenants_request_does_nothing():
    core = core_with("e1")
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    assert core.cancel("r1", "another tenant") == [] and "r1" in core.runs
    assert core.cancel("nope", "t1") == []
    assert [e for e in core.cancel("r1", "t1") if isinstance(e, Finished)]
    assert core.cancel("r1", "t1") == []  # again: a no-op


def test_a_queued_request_cancelled_in_the_core_charged_nothing():
    core = core_with()  # no executor: nothing can be dispatched
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    core.schedule(0.0)
    effects = core.cancel("r1", "t1")
    (f,) = [e for e in effects if isinstance(e, Finished)]
    assert f.result.status == "cancelled" and f.result.gpu_s == 0.0 and f.result.nodes_run == 0
    assert not [e for e in effects if isinstance(e, ChargeVTime | SendCancel)]


def test_every_completion_appends_a_node_event_counting_nodes_and_steps():
    spec = sim_workflow("wf", "sd3-medium", steps=3)
    dag = unroll(spec, resolve_params(spec, {"prompt": "p"}))
    core = core_with()
    fns = sorted({n.fn for n in dag.nodes.values()})
    core.on_heartbeat(ExecutorHeartbeat("e1", "cpu", "shm", "seg-e1", fns, seq=1), 0.0)
    core.add_request(request(), dag, attempt=1, now=0.0)
    events: list[dict] = []
    while core.runs:
        (d,) = on(core, "e1")
        events += [e.data for e in core.on_complete(complete(d), 0.0) if isinstance(e, AppendEvent)]
    assert [e["done"] for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in events if e["node_id"].startswith("dit@")] == [1, 2, 3]
    assert events[-1]["step"] == events[-1]["steps"] == 3 and events[-1]["total"] == 6
    assert events[-1]["gpu_s"] == pytest.approx(3.0)  # 6 nodes of 0.5 s
    assert set(events[0]["timing"]) == {"load_s", "fetch_s", "exec_s", "store_s", "load_tier"}


def test_steps_are_the_iterations_of_top_level_loops():
    class Nodes:  # step_units reads node ids only
        def __init__(self, ids):
            self.nodes = dict.fromkeys(ids)

    # Two steps of a loop (a ControlNet, the base model, and a nested loop of two), then a refiner
    # loop of one iteration.
    ids = ["text", "cn@0", "dit@0", "in@0.0", "in@0.1", "cn@1", "dit@1", "in@1.0", "in@1.1", "ref@0", "vae"]
    step_of, sizes = progress.step_units(Nodes(ids))  # type: ignore[arg-type]
    assert "text" not in step_of and "vae" not in step_of
    assert step_of["in@1.1"] == step_of["in@1.0"] == step_of["dit@1"] == step_of["cn@1"]
    assert step_of["ref@0"] != step_of["dit@0"]  # another loop (one iteration, not two)
    assert len(sizes) == 3 and sizes[step_of["dit@1"]] == 4
