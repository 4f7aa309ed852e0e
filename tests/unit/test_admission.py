"""Admission from the per-tenant backlog to the core (``services/scheduler/core/admission.py``): the order
is the policy's (least vTime first, joiners placed as the policy lifts them), FIFO within a tenant,
global arrival order for the FIFO baseline; queued requests past their deadline are answered."""

from __future__ import annotations

from services.scheduler.core.accounting import TenantAccount
from services.scheduler.core.admission import Backlog, Queued, by_arrival, rank_for
from services.scheduler.core.effects import Finished
from services.scheduler.core.policy import get_policy
from services.scheduler.core.scheduling import SchedulerCore
from tests.unit.test_scheduler_core import complete, dispatches, hb, request, toy_dag

FAIR = rank_for("fair", slack_s=5.0)


def q(seq: int, tenant: str, deadline: float = 1e9) -> Queued:
    return Queued(seq, request(f"{tenant}{seq}", tenant), None, 1, deadline)  # type: ignore[arg-type]


def backlog(*items: Queued) -> Backlog:
    b = Backlog()
    for item in items:
        b.push(item)
    return b


def order(b: Backlog, rank, tenants) -> list[str]:
    out = []
    while (item := b.pop(rank, tenants)) is not None:
        out.append(item.req.request_id)
    return out


def test_within_a_tenant_requests_leave_in_arrival_order_even_if_taken_in_out_of_order():
    b = backlog(q(1, "a"), q(3, "a"), q(2, "a"), q(5, "a"), q(4, "a"))
    assert len(b) == 5 and b.counts() == {"a": 5}
    assert order(b, FAIR, {}) == ["a1", "a2", "a3", "a4", "a5"]
    assert len(b) == 0 and b.pop(FAIR, {}) is None


def test_a_new_tenant_goes_ahead_of_the_backlog_of_the_tenant_holding_the_active_set():
    b = backlog(*(q(i, "a") for i in range(1, 50)), q(50, "b"))
    tenants = {"a": TenantAccount(vtime=40.0, requests=4)}
    # b is lifted to a's vTime (it banks no credit), and wins the tie with fewer requests in the core.
    assert b.pop(FAIR, tenants).req.request_id == "b50"
    assert b.pop(FAIR, tenants).req.request_id == "a1"


def test_a_tenant_with_less_vtime_goes_first_and_ties_go_to_fewer_requests_then_the_oldest():
    tenants = {
        "a": TenantAccount(vtime=10.0, requests=3),
        "b": TenantAccount(vtime=9.0, requests=1),
        "c": TenantAccount(vtime=9.0, requests=2),
    }
    b = backlog(q(1, "a"), q(2, "c"), q(3, "b"))
    assert b.pop(FAIR, tenants).tenant == "b"
    tenants["b"].vtime = 11.0
    assert b.pop(FAIR, tenants).tenant == "c"
    tenants["c"].requests = 3
    b.push(q(4, "c"))
    tenants["c"].vtime = 10.0  # tied with a on vTime and requests: a's request is older
    assert b.pop(FAIR, tenants).tenant == "a"


def test_a_returning_tenant_is_not_held_back_by_earlier_service_nor_helped_by_its_absence():
    tenants = {"a": TenantAccount(vtime=10.0, requests=2), "b": TenantAccount(vtime=100.0)}
    b = backlog(q(1, "a"), q(2, "a"), q(3, "b"))
    assert b.pop(FAIR, tenants).tenant == "b"  # ranked at a's 10, not 100; fewer requests in the core
    # Two joiners both rank at the least vTime in the core: the one with credit (-50) gains nothing.
    tenants = {"a": TenantAccount(vtime=10.0, requests=2), "c": TenantAccount(vtime=-50.0)}
    tenants["e"] = TenantAccount(vtime=100.0)
    b = backlog(q(1, "e"), q(2, "c"))
    assert order(b, FAIR, tenants) == ["e1", "c2"]


def test_with_nobody_in_the_core_joiners_are_raised_to_within_the_slack_of_the_most_served():
    tenants = {"a": TenantAccount(vtime=100.0), "b": TenantAccount(vtime=0.0)}
    b = backlog(q(1, "a"), q(2, "b"))
    assert b.pop(FAIR, tenants).tenant == "b"  # 95 < 100
    b = backlog(q(1, "a"), q(2, "b"))
    assert b.pop(rank_for("fair", slack_s=0.0), tenants).tenant == "a"  # both 100: the older


def test_fifo_and_sjf_admit_in_global_arrival_order_whatever_the_vtime():
    tenants = {"a": TenantAccount(vtime=1000.0, requests=4), "b": TenantAccount(vtime=0.0, requests=1)}
    for policy in ("fifo", "sjf"):
        assert rank_for(policy) is by_arrival
        b = backlog(q(1, "a"), q(2, "b"), q(3, "a"), q(4, "b"))
        assert order(b, rank_for(policy), tenants) == ["a1", "b2", "a3", "b4"]


def test_vtc_admits_by_operations_and_lifts_a_joiner_only_up():
    vtc = rank_for("vtc")
    tenants = {"a": TenantAccount(ops=50, requests=2), "b": TenantAccount(ops=10)}
    b = backlog(q(1, "a"), q(2, "b"))
    assert b.pop(vtc, tenants).tenant == "b"  # lifted to 50, fewer requests in the core
    tenants = {"a": TenantAccount(ops=50, requests=2), "b": TenantAccount(ops=80)}
    b = backlog(q(1, "a"), q(2, "b"))
    assert b.pop(vtc, tenants).tenant == "a"  # 80 is kept: VTC never lowers a count


def test_expired_removes_only_the_requests_past_their_deadline():
    b = backlog(q(1, "a", deadline=5.0), q(2, "a", deadline=50.0), q(3, "b", deadline=5.0))
    assert [x.req.request_id for x in b.expired(4.9)] == []
    assert sorted(x.req.request_id for x in b.expired(5.0)) == ["a1", "b3"]
    assert len(b) == 1 and b.counts() == {"a": 1}


def test_end_to_end_through_the_core_a_late_tenant_finishes_long_before_the_backlog_drains():
    """The real core and fair policy, one executor, an active set of 2: tenant a queues 30
    requests, then tenant b one; b's request finishes while most of a's are still queued."""
    core = SchedulerCore(get_policy("fair", 0.5))
    core.on_heartbeat(hb("e1"), 0.0)
    b = backlog(*(Queued(i, request(f"a{i}", "a"), toy_dag(), 1, 1e9) for i in range(30)))
    rank = rank_for("fair", slack_s=0.5)
    finished: list[str] = []
    pending = []
    now = 0.0

    def admit() -> None:
        while core.active < 2 and (item := b.pop(rank, core.accounts.tenants)) is not None:
            core.add_request(item.req, item.dag, attempt=1, now=now, deadline=item.deadline)
            pending.extend(dispatches(core.schedule(now)))

    admit()
    steps = 0
    while pending or len(b):
        if steps == 3:
            b.push(Queued(100, request("b0", "b"), toy_dag(), 1, 1e9))
        d = pending.pop(0)
        now += 0.5
        effects = core.on_complete(complete(d), now)
        finished += [e.result.request_id for e in effects if isinstance(e, Finished)]
        pending.extend(dispatches(core.schedule(now)))
        admit()
        steps += 1
    assert len(finished) == 31 and finished.count("b0") == 1
    assert finished.index("b0") <= 4, finished  # not behind a's 30
