"""The scheduler's guards, driven through the I/O-free core (no broker): deadlines counted from
submission, expired work never dispatched, a node time limit that takes work off a hung executor,
and completions whose timings are not finite and >= 0 refused (never charged as vTime)."""

from __future__ import annotations

import math

import msgspec
import pytest

from libs.protocol.ids import NodeRef
from libs.protocol.messages import (
    CancelNode,
    ImageRequest,
    NodeComplete,
    NodeFailed,
    NodeTiming,
    encode,
    sched_decoder,
)
from services.scheduler.core.deadlines import MAX_AGE_S, MAX_FUTURE_S, deadline_of
from services.scheduler.core.effects import ChargeVTime, Finished, ReleaseAttempt, SendCancel, SendDispatch
from services.scheduler.core.guards import timing_problem
from services.scheduler.core.lifecycle import NodeState
from services.scheduler.core.policy import fifo
from services.scheduler.core.scheduling import SchedulerCore
from tests.unit.test_scheduler_core import complete, dispatches, drive, hb, request, toy_dag

WALL = 1_700_000_000.0  # unix seconds "now" in these tests; the monotonic clock reads 50.0 then


def req_at(submitted_at: float, timeout_s: float = 30.0) -> ImageRequest:
    return ImageRequest("r1", "t1", "toy", 1, {"prompt": "p"}, submitted_at=submitted_at, timeout_s=timeout_s)


def finished(effects) -> list[Finished]:
    return [e for e in effects if isinstance(e, Finished)]


# -- deadlines from submitted_at ------------------------------------------------------------------------
def test_the_deadline_counts_from_submission_not_from_intake():
    d = deadline_of(req_at(WALL - 10.0, timeout_s=30.0), wall=WALL, now=50.0)
    assert d.at == pytest.approx(70.0) and d.skew == "" and not d.passed(69.9) and d.passed(70.0)


def test_a_request_submitted_longer_ago_than_its_timeout_is_expired_when_taken_in():
    d = deadline_of(req_at(WALL - 31.0, timeout_s=30.0), wall=WALL, now=50.0)
    assert d.passed(50.0) and d.skew == ""


@pytest.mark.parametrize(
    "submitted_at",
    [WALL + MAX_FUTURE_S + 1.0, WALL + 1e9, WALL - MAX_AGE_S - 1.0, 0.0, math.nan, math.inf, -math.inf],
)
def test_an_absurd_submission_time_is_clamped_to_intake_and_said_why(submitted_at):
    d = deadline_of(req_at(submitted_at, timeout_s=30.0), wall=WALL, now=50.0)
    assert d.at == pytest.approx(80.0) and d.submitted_at == WALL and d.skew


def test_a_gateway_clock_a_little_ahead_is_believed():
    d = deadline_of(req_at(WALL + 20.0, timeout_s=30.0), wall=WALL, now=50.0)
    assert d.at == pytest.approx(100.0) and d.skew == ""


def test_a_request_already_past_its_deadline_fails_with_timeout_and_nothing_is_dispatched():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 50.0)
    core.add_request(request(), toy_dag(), attempt=1, now=50.0, deadline=49.0)
    effects = core.schedule(50.0)
    assert dispatches(effects) == []
    (f,) = finished(effects)
    assert f.result.status == "failed" and f.result.error_code == "timeout" and core.active == 0


def test_a_request_that_expires_mid_run_gets_no_further_dispatch():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0, deadline=10.0)
    (d,) = dispatches(core.schedule(0.0))
    core.on_complete(complete(d), 10.5)  # its successors are ready, and e1 is idle, but time is up
    effects = core.schedule(10.5)
    assert dispatches(effects) == []
    (f,) = finished(effects)
    assert f.result.error_code == "timeout" and "1 of" in f.result.error


def test_without_a_deadline_the_core_counts_from_when_it_took_the_request_in():
    core = SchedulerCore(fifo)
    core.add_request(request(timeout_s=10.0), toy_dag(), attempt=1, now=5.0)
    assert core.runs["r1"].deadline == 15.0


# -- the node time limit ---------------------------------------------------------------------------------
def test_a_node_past_its_time_limit_is_requeued_elsewhere_and_its_executor_gets_no_more_work():
    core = SchedulerCore(fifo, node_time_limit_s=5.0, heartbeat_timeout_s=1e9)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.dispatch_result(d.msg.ref, "e1", ok=True, seq=1, error="", now=0.0)
    core.on_heartbeat(hb("e2"), 1.0)
    (other,) = dispatches(core.schedule(1.0))  # e2 takes the other root
    core.on_complete(complete(other), 1.5)
    assert core.expire(4.0) == []  # within the limit
    ref = d.msg.ref
    # Requeued, and e1 told to stop it (restarting if its runner cannot stop the node's thread).
    cancel = CancelNode(ref.request_id, ref.attempt, ref.node_id, restart_ok=True)
    assert core.expire(5.5) == [SendCancel("e1", cancel)]
    rec = core.runs["r1"].nodes[d.msg.node_id]
    assert rec.state is NodeState.READY and rec.retries == 1
    assert core.executors["e1"].hung == d.msg.ref and not core.executors["e1"].idle
    (again,) = dispatches(core.schedule(5.5))
    assert again.msg.ref == d.msg.ref and again.executor == "e2"  # elsewhere
    # e1 still reports the node: it stays out of placement.
    core.on_heartbeat(hb("e1", seq=9, running=[d.msg.ref.encode()]), 6.0)
    assert core.executors["e1"].hung == d.msg.ref and core.stats()["hung_executors"] == 1
    # Its late completion is stale: the live attempt's tensors are not released, e1 is free again.
    assert core.on_complete(complete(d), 7.0) == []
    assert core.executors["e1"].hung is None and core.executors["e1"].idle
    effects = core.on_complete(complete(again), 7.5)
    assert not any(isinstance(e, ReleaseAttempt) for e in effects)
    (f,) = finished(drive(core, 8.0))
    assert f.result.status == "succeeded"


def test_a_hung_executor_takes_work_again_once_its_heartbeat_no_longer_reports_the_node():
    core = SchedulerCore(fifo, node_time_limit_s=5.0, heartbeat_timeout_s=1e9)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.expire(6.0)
    assert core.stats()["idle_executors"] == 0
    core.on_heartbeat(hb("e1", seq=5, running=[]), 7.0)  # gave up on it, or restarted
    (again,) = dispatches(core.schedule(7.0))
    assert again.executor == "e1" and again.msg.ref == d.msg.ref


def test_the_time_limit_stretches_to_a_multiple_of_the_estimate():
    core = SchedulerCore(fifo, node_time_limit_s=5.0, node_time_factor=10.0, heartbeat_timeout_s=1e9)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.runs["r1"].nodes[d.msg.node_id].charge_s = 2.0  # estimated 2 s: may run 20 s
    core.expire(19.0)
    assert core.runs["r1"].nodes[d.msg.node_id].state is NodeState.DISPATCHED
    core.expire(20.5)
    assert core.runs["r1"].nodes[d.msg.node_id].state is NodeState.READY


def test_a_node_that_overruns_every_time_fails_its_request_with_timeout():
    core = SchedulerCore(fifo, node_time_limit_s=5.0, max_node_retries=1, heartbeat_timeout_s=1e9)
    for e in ("e1", "e2"):
        core.on_heartbeat(hb(e), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    first = dispatches(core.schedule(0.0))
    stuck = first[0]
    for other in first[1:]:
        core.on_complete(complete(other), 0.5)
    core.expire(6.0)
    (again,) = [d for d in dispatches(core.schedule(6.0)) if d.msg.ref == stuck.msg.ref]
    (f,) = finished(core.expire(12.0))
    assert f.result.error_code == "timeout" and "time limit" in f.result.error


def test_a_zero_limit_turns_the_watchdog_off():
    core = SchedulerCore(fifo, node_time_limit_s=0.0, heartbeat_timeout_s=1e9)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(timeout_s=1e9), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.expire(1e6)
    assert core.runs["r1"].nodes[d.msg.node_id].state is NodeState.DISPATCHED


# -- executors' timings ------------------------------------------------------------------------------------
def forged(timing: bytes) -> bytes:
    good = encode(NodeComplete("e1", "r1", 1, "n", timing=NodeTiming(exec_s=1.0)))
    return good.replace(b'{"exec_s":1.0}', timing)


@pytest.mark.parametrize(
    "timing",
    [
        b'{"exec_s":-1.0}',
        b'{"load_s":-0.5}',
        b'{"fetch_s":-1e-9}',
        b'{"store_s":-3}',
        b'{"exec_s":NaN}',
        b'{"exec_s":Infinity}',
        b'{"exec_s":1e999}',
        b'{"exec_s":null}',
        b'{"exec_s":1e7}',
        b'{"load_bytes":-1}',
        b'{"load_frac":1.5}',
    ],
)
def test_the_events_decoder_refuses_timings_that_are_not_finite_and_non_negative(timing):
    with pytest.raises(msgspec.DecodeError):
        sched_decoder.decode(forged(timing))


def test_the_events_decoder_takes_sound_timings():
    ev = sched_decoder.decode(forged(b'{"load_s":0.0,"fetch_s":0.25,"exec_s":1.5,"store_s":0}'))
    assert isinstance(ev, NodeComplete) and ev.timing.total_s == pytest.approx(1.75)


@pytest.mark.parametrize(
    "timing",
    [
        NodeTiming(exec_s=-5.0),
        NodeTiming(exec_s=math.nan),
        NodeTiming(load_s=math.inf),
        NodeTiming(fetch_s=-math.inf),
        NodeTiming(store_s=2e6),
        NodeTiming(load_frac=-0.1),
    ],
)
def test_the_core_refuses_a_bad_timing_reruns_the_node_and_charges_nothing_for_it(timing):
    assert timing_problem(timing) is not None
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    vtime = core.accounts["t1"].vtime
    bad = NodeComplete(d.executor, "r1", 1, d.msg.node_id, complete(d).outputs, timing=timing)
    effects = core.on_complete(bad, 0.5)
    assert not any(isinstance(e, ChargeVTime) for e in effects) and not finished(effects)
    assert core.accounts["t1"].vtime == vtime and core.accounts["t1"].service_s == 0.0
    assert core.estimator.estimate(d.msg.fn, d.msg.model) == pytest.approx(0.1)  # nothing learnt
    (again,) = dispatches(core.schedule(0.5))
    assert again.msg.ref == d.msg.ref  # treated as lost: it runs again
    core.on_complete(complete(again), 1.0)
    (f,) = finished(drive(core, 1.0))
    assert f.result.status == "succeeded" and core.accounts["t1"].vtime >= 0.0


def test_rejecting_a_completion_of_a_node_not_in_flight_there_changes_nothing():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    assert core.reject_completion(NodeRef("r1", 1, d.msg.node_id), "e9", 0.1, "bad") == []
    assert core.reject_completion(NodeRef("zz", 1, "n"), "e1", 0.1, "bad") == []
    assert core.runs["r1"].nodes[d.msg.node_id].state is NodeState.DISPATCHED


def test_sound_timings_pass_the_guard():
    assert timing_problem(NodeTiming()) is None
    assert timing_problem(NodeTiming(load_s=1.0, fetch_s=0.1, exec_s=2.0, store_s=0.2, load_frac=1.0)) is None


def test_an_executor_lost_mid_request_keeps_the_attempt_and_the_survivors_completion_counts():
    """Lineage re-execution (docs/scheduling.md): the lost executor's finished node runs again in
    the same attempt; the node still running elsewhere is neither cancelled nor stale."""
    core = SchedulerCore(fifo, heartbeat_timeout_s=3.0)
    core.on_heartbeat(hb("e1"), 0.0)
    core.on_heartbeat(hb("e2"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    first = dispatches(core.schedule(0.0))
    on_e1 = next(d for d in first if d.executor == "e1")
    on_e2 = next(d for d in first if d.executor == "e2")
    core.on_complete(complete(on_e1), 0.5)
    core.on_heartbeat(hb("e2", seq=2, running=[on_e2.msg.ref.encode()]), 2.0)
    lost = core.expire(4.0)  # e1's heartbeat is 4 s old: it is gone, with on_e1's output
    run = core.runs["r1"]
    assert run.attempt == 1 and not cancels(lost)
    assert not any(isinstance(e, ReleaseAttempt) for e in lost)
    assert run.nodes[on_e1.msg.node_id].state in (NodeState.READY, NodeState.DISPATCHED)
    effects = core.on_complete(complete(on_e2), 4.5)
    assert not any(isinstance(e, ReleaseAttempt) for e in effects)
    assert run.nodes[on_e2.msg.node_id].state is NodeState.DONE


def test_dispatches_are_sent_only_for_live_requests():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request("r1"), toy_dag(), attempt=1, now=0.0, deadline=1.0)
    core.add_request(request("r2"), toy_dag(), attempt=1, now=0.0, deadline=100.0)
    effects = core.schedule(2.0)
    (d,) = [e for e in effects if isinstance(e, SendDispatch)]
    assert d.msg.request_id == "r2"
    assert [f.result.request_id for f in finished(effects)] == ["r1"]


def cancels(effects) -> list[SendCancel]:
    return [e for e in effects if isinstance(e, SendCancel)]


def test_a_cancelled_node_answers_failed_and_its_executor_takes_work_again_at_once():
    core = SchedulerCore(fifo, node_time_limit_s=5.0, heartbeat_timeout_s=1e9)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.dispatch_result(d.msg.ref, "e1", ok=True, seq=1, error="", now=0.0)
    (cancel,) = cancels(core.expire(5.5))
    assert cancel.executor == "e1" and cancel.msg.restart_ok and core.executors["e1"].hung == d.msg.ref
    ref = d.msg.ref
    answer = NodeFailed("e1", ref.request_id, ref.attempt, ref.node_id, "cancelled by the scheduler", True)
    assert core.on_failed(answer, 5.6) == []  # stale: the node was requeued already
    assert core.executors["e1"].hung is None and core.executors["e1"].idle
    (again,) = dispatches(core.schedule(5.6))
    assert again.msg.ref == ref and core.runs["r1"].nodes[ref.node_id].retries == 1  # counted once


def test_a_request_that_fails_cancels_its_nodes_still_running_but_not_the_one_that_failed():
    core = SchedulerCore(fifo, node_time_limit_s=0.0, heartbeat_timeout_s=1e9)
    for e in ("e1", "e2"):
        core.on_heartbeat(hb(e), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    a, b = dispatches(core.schedule(0.0))
    ref = a.msg.ref
    effects = core.on_failed(
        NodeFailed(a.executor, ref.request_id, ref.attempt, ref.node_id, "bad", False), 1.0
    )
    (f,) = finished(effects)
    assert f.result.status == "failed"
    other = b.msg.ref
    # A request that ended does not restart an executor over it: no restart_ok.
    assert cancels(effects) == [
        SendCancel(b.executor, CancelNode(other.request_id, other.attempt, other.node_id))
    ]


def test_an_executor_lost_with_a_node_in_flight_requeues_it_and_cancels_no_other():
    core = SchedulerCore(fifo, node_time_limit_s=0.0, heartbeat_timeout_s=1e9)
    for e in ("e1", "e2"):
        core.on_heartbeat(hb(e), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    a, b = dispatches(core.schedule(0.0))
    effects = core.remove_executor(a.executor, 1.0, "test")
    run = core.runs["r1"]
    assert cancels(effects) == [] and run.attempt == 1  # b reads nothing of the lost executor's
    assert run.nodes[a.msg.node_id].state is NodeState.READY and run.nodes[a.msg.node_id].retries == 0
    assert run.nodes[b.msg.node_id].state in (NodeState.DISPATCHED, NodeState.RUNNING)
