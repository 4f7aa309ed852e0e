"""The scheduler's state machine (``services/scheduler/core/machine.py``): a request's life from taken in
to finished, driven by events alone — admission from the backlog in the policy's order, deadlines
in the backlog, the per-tenant backlog limit, cancels wherever the request is, dispatch tokens,
answers and timeouts, a refusal for a newer epoch — with the real core and fair policy."""

from __future__ import annotations

import pickle

from libs.protocol.messages import STALE_EPOCH
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.admission import Queued
from services.scheduler.core.effects import (
    CancelDone,
    Finished,
    SendDispatch,
    StepDown,
    WriteBacklog,
    WriteViews,
)
from services.scheduler.core.events import Cancel, DispatchAnswer, FromExecutor, Round, Seed, TakenIn, Tick
from services.scheduler.core.machine import SchedulerMachine
from services.scheduler.core.policy import get_policy
from services.scheduler.core.scheduling import SchedulerCore
from tests.unit.test_scheduler_core import hb, request, toy_dag


def machine(**cfg) -> SchedulerMachine:
    c = SchedulerConfig(**cfg)
    return SchedulerMachine(SchedulerCore(get_policy(c.policy, c.slack_s)), c)


def taken(seq: int, tenant: str, deadline: float = 1e9) -> TakenIn:
    return TakenIn(Queued(seq, request(f"{tenant}{seq}", tenant), toy_dag(), 1, deadline))


def finished(effects) -> dict[str, str]:
    return {
        e.result.request_id: e.result.error_code or e.result.status
        for e in effects
        if isinstance(e, Finished)
    }


def test_admits_in_the_policy_order_up_to_the_room_and_answers_late_queued_requests_timeout():
    m = machine(max_active=1)
    m.handle(Seed({"a": 100.0}, {}, {}), 0.0)  # tenant a has been served: b goes first
    for ev in (
        taken(1, "a", deadline=10.0),
        taken(2, "a"),
        taken(3, "a"),
        taken(4, "b", deadline=10.0),
        taken(5, "b"),
    ):
        assert m.handle(ev, 0.5) == []
    assert m.held == 5 and not m.core.runs
    assert finished(m.handle(Round(), 1.0)) == {}
    assert list(m.core.runs) == ["b4"] and len(m.backlog) == 4 and not m.more
    # At 20 s a1 (queued) and b4 (in the core) are past their deadlines: both answered timeout.
    ticked = m.handle(Tick(wall=1000.0), 20.0)
    assert finished(ticked) == {"a1": "timeout", "b4": "timeout"}
    (late,) = [e for e in ticked if isinstance(e, Finished) and e.result.request_id == "a1"]
    assert "queued for admission" in late.result.error and late.tenant == "a"
    assert [e.counts for e in ticked if isinstance(e, WriteBacklog)] == [{"a": 2, "b": 1}]
    assert any(isinstance(e, WriteViews) for e in ticked)
    m.handle(Round(), 20.0)  # b4's room goes to the next in the policy's order
    assert len(m.core.runs) == 1 and len(m.backlog) == 2 and "b4" not in m.core.runs


def test_a_tenant_at_its_backlog_limit_has_the_next_request_answered_rate_limited():
    m = machine(max_active=1, max_tenant_backlog=2)
    assert m.handle(taken(1, "a"), 0.0) == [] and m.handle(taken(2, "a"), 0.0) == []
    assert finished(m.handle(taken(3, "a"), 0.0)) == {"a3": "rate_limited"}
    assert m.handle(taken(4, "b"), 0.0) == []  # another tenant is not held up
    assert m.backlog.counts() == {"a": 2, "b": 1}


def test_a_cancel_reaches_the_request_in_the_backlog_or_in_the_core_and_only_for_its_tenant():
    m = machine(max_active=1)
    m.handle(FromExecutor(hb("e1")), 0.0)
    m.handle(taken(1, "a"), 0.0)
    m.handle(taken(2, "a"), 0.0)
    m.handle(Round(), 0.0)
    assert list(m.core.runs) == ["a1"] and len(m.backlog) == 1
    assert m.handle(Cancel("a2", "mallory"), 1.0) == []  # another tenant's: ignored
    queued = m.handle(Cancel("a2", "a", "changed my mind"), 1.0)
    assert finished(queued) == {"a2": "cancelled"} and CancelDone("a2") in queued and not len(m.backlog)
    running = m.handle(Cancel("a1", None), 1.0)  # from the poll: trusted
    assert finished(running) == {"a1": "cancelled"} and CancelDone("a1") in running
    assert m.handle(Cancel("a1", None), 2.0) == []  # ended: nothing
    assert m.cancelled == 2


def test_dispatches_carry_tokens_and_an_unanswered_one_times_out_on_a_tick():
    m = machine(dispatch_timeout_s=2.0)
    m.handle(FromExecutor(hb("e1")), 0.0)
    m.handle(taken(1, "a"), 0.0)
    (d,) = [e for e in m.handle(Round(), 1.0) if isinstance(e, SendDispatch)]
    assert d.token == 1 and d.deadline == 3.0 and m.pending[1][0] == d.msg.ref
    m.handle(Tick(wall=0.0), 2.9)
    assert 1 in m.pending  # not yet
    m.handle(Tick(wall=0.0), 3.0)
    assert not m.pending and m.core.executors["e1"].suspect
    assert m.handle(DispatchAnswer(1, True, seq=1), 3.1) == []  # too late: already treated as lost


def test_an_answer_for_a_newer_epoch_steps_the_leader_down():
    m = machine()
    m.handle(FromExecutor(hb("e1")), 0.0)
    m.handle(taken(1, "a"), 0.0)
    (d,) = [e for e in m.handle(Round(), 0.0) if isinstance(e, SendDispatch)]
    (down,) = m.handle(DispatchAnswer(d.token, False, error=STALE_EPOCH), 0.1)
    assert isinstance(down, StepDown) and "newer scheduler" in down.reason


def test_the_machine_pickles_with_requests_queued_and_running():
    """What a recording starts from (``replay.py``): the whole machine, policy and backlog included."""
    m = machine(max_active=1)
    m.handle(FromExecutor(hb("e1")), 0.0)
    m.handle(taken(1, "a"), 0.0)
    m.handle(taken(2, "a"), 0.0)
    m.handle(Round(), 0.0)
    copy = pickle.loads(pickle.dumps(m))
    assert list(copy.core.runs) == ["a1"] and [q.req.request_id for q in copy.backlog] == ["a2"]
    assert repr(copy.handle(Tick(wall=5.0), 9.0)) == repr(m.handle(Tick(wall=5.0), 9.0))
