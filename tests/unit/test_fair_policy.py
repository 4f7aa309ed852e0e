"""Algorithm 1 and the baselines on hand-built snapshots, and vTime accounting in the core (no broker)."""

from __future__ import annotations

import pytest

from libs.protocol.ids import ModelKey, NodeRef
from libs.protocol.messages import ExecutorHeartbeat, ImageRef, ImageRequest, NodeComplete, NodeTiming
from libs.protocol.tensor_meta import TensorMeta
from libs.workflow.dag import Dag, DagNode, TensorSource
from services.scheduler.core.accounting import Accounts
from services.scheduler.core.effects import ChargeVTime, SendDispatch
from services.scheduler.core.estimates import Estimator, shape_key
from services.scheduler.core.policy import fair, fifo, get_policy, sjf, vtc, vtime_lifts
from services.scheduler.core.scheduling import SchedulerCore
from services.scheduler.core.snapshot import Decision, ExecutorInfo, ReadyNode, Snapshot, TenantView, best_fit

FNS = frozenset({"f.a", "f.b", "f.c"})


def node(
    request_id: str,
    tenant: str,
    *,
    fn: str = "f.a",
    model: str = "m",
    submitted: float = 0.0,
    ready: float = 0.0,
    est: float = 1.0,
    rem: float = 1.0,
    load: float = 0.0,
    job: float = 1.0,
    inputs=(),
) -> ReadyNode:
    """The ready node ``x`` of attempt 1 of request ``request_id``."""
    return ReadyNode(
        NodeRef(request_id, 1, "x"), tenant, fn, model, 0, submitted, ready, inputs, est, load, rem, job
    )


def ex(
    eid: str, resident=(), fns=FNS, load: float = 0.0, arena_free: int = 0, arena: int = 0
) -> ExecutorInfo:
    """An idle executor; ``resident`` names models as ``(fn, model)`` pairs, ``arena`` its capacity."""
    return ExecutorInfo(
        eid,
        frozenset(fns),
        frozenset(ModelKey(*m) for m in resident),
        load,
        arena_free=arena_free,
        arena_capacity=arena,
    )


def placed(d: Decision) -> list[str]:
    """The requests whose nodes a decision dispatches, in order."""
    return [a.node.request_id for a in d.assignments]


def snap(ready, idle, tenants, now: float = 10.0) -> Snapshot:
    return Snapshot(now=now, ready=tuple(ready), idle=tuple(idle), tenants=tenants)


# -- vTime lift ---------------------------------------------------------------------------------------
def test_a_joining_tenant_is_placed_between_the_least_served_eligible_tenant_and_delta_above_it():
    tenants = {
        "a": TenantView(vtime=50.0),
        "b": TenantView(vtime=30.0),  # active, but no ready work: not eligible, not a reference
        "new": TenantView(vtime=0.0, returning=True),  # stale low vTime: no banked priority
        "back_heavy": TenantView(vtime=90.0, returning=True),  # got 40 s while nobody else waited
        "rejoin": TenantView(vtime=52.0, rejoining=True),  # within [50, 55]: left as it is
        "idle": TenantView(vtime=0.0, returning=True),  # no ready work: not joining yet
    }
    ready = [node(f"r{i}", t) for i, t in enumerate(("a", "new", "back_heavy", "rejoin"))]
    assert vtime_lifts(snap(ready, [ex("e")], tenants), slack_s=5.0) == {"new": 50.0, "back_heavy": 55.0}


def test_tenants_joining_together_with_nobody_waiting_are_lifted_within_delta_of_the_most_served():
    tenants = {
        "f": TenantView(vtime=15.0, rejoining=True),
        "g": TenantView(vtime=4.0, rejoining=True),
        "h": TenantView(vtime=13.0, returning=True),
    }
    ready = [node("f", "f"), node("g", "g"), node("h", "h")]
    assert vtime_lifts(snap(ready, [ex("e")], tenants), slack_s=1.0) == {"g": 14.0, "h": 14.0}
    assert vtime_lifts(snap(ready[:1], [ex("e")], {"f": TenantView(vtime=3.0, returning=True)})) == {}


def test_the_fair_policy_applies_the_lift_before_comparing_tenants():
    # Without the lift, "new" (vTime 0) would win; lifted to 30 it ties with b and the score decides.
    tenants = {"b": TenantView(vtime=30.0), "new": TenantView(vtime=0.0, returning=True)}
    ready = [node("r1", "new", ready=9.0), node("r2", "b", ready=0.0)]
    d = fair(snap(ready, [ex("e")], tenants), slack_s=0.0)
    assert d.lifts == {"new": 30.0}
    assert placed(d) == ["r2"]  # b waited 10 s, new 1 s


# -- Layer 1 -----------------------------------------------------------------------------------------
def test_layer1_admits_only_tenants_within_the_slack_of_the_least_served_one():
    tenants = {"low": TenantView(vtime=10.0), "mid": TenantView(vtime=14.0), "high": TenantView(vtime=16.0)}
    # "high" has the best score (waited longest, shortest) but is 6 s ahead: out with slack 5.
    ready = [
        node("h", "high", ready=0.0, est=0.1, rem=0.1),
        node("m", "mid", ready=5.0, est=1.0, rem=5.0),
        node("l", "low", ready=9.0, est=2.0, rem=9.0),
    ]
    d = fair(snap(ready, [ex("e")], tenants), slack_s=5.0)
    assert placed(d) == ["m"]  # mid is admitted (4 <= 5) and scores best
    d = fair(snap(ready, [ex("e")], tenants), slack_s=0.0)
    assert placed(d) == ["l"]  # strict: only the least served
    d = fair(snap(ready, [ex("e")], tenants), slack_s=100.0)
    assert placed(d) == ["h"]  # loose: pure Layer 2


def test_layer1_recomputes_after_each_charge_so_one_round_shares_executors_fairly():
    tenants = {"a": TenantView(vtime=0.0), "b": TenantView(vtime=0.0)}
    ready = [node(f"a{i}", "a", est=2.0, ready=0.0) for i in range(3)] + [
        node(f"b{i}", "b", est=2.0, ready=5.0) for i in range(3)
    ]
    d = fair(snap(ready, [ex(f"e{i}") for i in range(4)], tenants), slack_s=1.0)
    owners = [rid[0] for rid in placed(d)]
    assert sorted(owners) == ["a", "a", "b", "b"]  # a leads by 2 > 1 after each dispatch: alternate
    assert all(a.charge_s == 2.0 for a in d.assignments)


def test_layer1_ignores_tenants_whose_ready_work_no_idle_executor_can_run():
    tenants = {"a": TenantView(vtime=0.0), "b": TenantView(vtime=50.0)}
    ready = [node("a", "a", fn="f.gpu_only"), node("b", "b")]
    d = fair(snap(ready, [ex("e")], tenants), slack_s=0.0)
    assert placed(d) == ["b"]  # work-conserving


# -- Layer 2 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ready", "winner"),
    [
        ([node("w", "a", ready=0.0), node("n", "a", ready=9.0)], "w"),  # waited longer
        ([node("s", "a", rem=1.0), node("l", "a", rem=20.0)], "s"),  # less remaining work
        ([node("q", "a", est=0.1, rem=5.0), node("p", "a", est=4.0, rem=5.0)], "q"),  # faster
    ],
    ids=["waiting", "remaining", "execution"],
)
def test_layer2_scores_waiting_minus_remaining_minus_execution(ready, winner):
    d = fair(snap(ready, [ex("e")], {"a": TenantView()}), slack_s=5.0)
    assert placed(d)[0] == winner


def test_layer2_normalises_each_term_so_seconds_and_ratios_are_comparable():
    # w: 10 vs 0 s (normalised 1 vs 0); r: 100 vs 50 (1 vs .5); e: equal. Scores: 1-1-1 = -1 vs 0-.5-1 = -1.5
    ready = [
        node("old", "a", ready=0.0, rem=100.0, est=1.0),
        node("new", "a", ready=10.0, rem=50.0, est=1.0),
    ]
    d = fair(snap(ready, [ex("e")], {"a": TenantView()}), slack_s=5.0)
    assert placed(d)[0] == "old"


# -- placement and charges ----------------------------------------------------------------------------
def test_best_fit_placement_and_load_is_charged_only_where_the_model_is_not_resident():
    tenants = {"a": TenantView()}
    n = node("r", "a", est=1.0, load=3.0, inputs=(("e2", 100),))
    d = fair(snap([n], [ex("e1"), ex("e2"), ex("e3", resident={("f.a", "m")})], tenants))
    assert d.assignments[0].executor == "e3" and d.assignments[0].charge_s == 1.0
    d = fair(snap([n], [ex("e1", load=1.0), ex("e2", load=5.0)], tenants))
    assert d.assignments[0].executor == "e2" and d.assignments[0].charge_s == 4.0  # input local beats load


def test_a_node_goes_to_an_idle_executor_whose_arena_has_room_for_the_inputs_it_must_pull():
    tenants = {"a": TenantView()}
    n = node("r", "a", inputs=(("e0", 60), ("e9", 40)))  # 100 bytes, on executors that are busy
    full = ex("e1", resident={("f.a", "m")}, arena=1000, arena_free=99)  # otherwise the best fit
    roomy = ex("e2", load=5.0, arena=1000, arena_free=100)
    d = fair(snap([n], [full, roomy], tenants))
    assert [(a.node, a.executor) for a in d.assignments] == [(n.ref, "e2")]
    # Bytes already in an executor's arena need no room there: the holder of 60 pulls only 40.
    holder = ex("e0", load=9.0, arena=1000, arena_free=40)
    assert best_fit(n, [roomy, holder]).id == "e0"
    # An executor that reported no arena (capacity 0) is not held to its arena_free.
    assert best_fit(n, [ex("e3")]).id == "e3"
    # With room nowhere the node waits, and other work that fits takes the executor.
    other = node("s", "b")
    d = fair(snap([n, other], [full], {"a": TenantView(), "b": TenantView(vtime=100.0)}), slack_s=0.0)
    assert placed(d) == ["s"]
    assert placed(fifo(snap([n, other], [full], tenants))) == ["s"]


def test_baselines_order_by_arrival_job_size_and_operation_count():
    tenants = {"a": TenantView(ops=10), "b": TenantView(ops=2)}
    ready = [node("big", "a", submitted=0.0, job=60.0), node("small", "b", submitted=5.0, job=1.0)]
    one = [ex("e")]
    assert placed(fifo(snap(ready, one, tenants)))[0] == "big"
    assert placed(sjf(snap(ready, one, tenants)))[0] == "small"
    assert placed(vtc(snap(ready, one, tenants)))[0] == "small"
    tenants = {"a": TenantView(ops=10), "back": TenantView(ops=0, returning=True)}
    ready = [node("x", "a"), node("y", "back")]
    assert vtc(snap(ready, one, tenants)).op_lifts == {"back": 10}
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        get_policy("lottery")


# -- accounting in the core ----------------------------------------------------------------------------
def chain(n: int, fn: str = "f.a") -> Dag:
    nodes = {}
    for i in range(n):
        deps = frozenset({f"n{i - 1}"}) if i else frozenset()
        inputs = {"x": TensorSource(f"n{i - 1}", "y")} if i else {}
        nodes[f"n{i}"] = DagNode(f"n{i}", fn, "m", inputs, frozenset(), ("y",), deps, i)
    consumers = {TensorSource(f"n{i}", "y"): 1 for i in range(n - 1)}
    successors = {f"n{i}": ([f"n{i + 1}"] if i < n - 1 else []) for i in range(n)}
    return Dag(nodes, {"image": TensorSource(f"n{n - 1}", "y")}, consumers, successors)


def done(d: SendDispatch, total_s: float, load_s: float = 0.0) -> NodeComplete:
    m = d.msg
    outs = {
        o.name: TensorMeta(m.ref.output(o.name).encode(), d.executor, "shm", "s", 0, 4, "float32", [1])
        for o in m.outputs
        if o.consumers
    }
    sinks = {o.name: ImageRef("b", o.sink, 1, 1, 1) for o in m.outputs if o.sink}
    return NodeComplete(
        d.executor,
        m.request_id,
        m.attempt,
        m.node_id,
        outs,
        sinks,
        NodeTiming(load_s=load_s, exec_s=total_s - load_s),
    )


def test_dispatch_charges_the_estimate_and_completion_replaces_it_with_the_measured_time():
    est = Estimator(default_s=2.0)
    core = SchedulerCore(get_policy("fair", 5.0), estimator=est)
    core.on_heartbeat(ExecutorHeartbeat("e1", "cpu", "shm", "s", ["f.a"]), 0.0)
    core.add_request(ImageRequest("r1", "alice", "w", 1, {}, 0.0), chain(2), attempt=1, now=0.0)
    effects = core.schedule(0.0)
    (d,) = [e for e in effects if isinstance(e, SendDispatch)]
    assert ChargeVTime("alice", delta=2.0, ops=1) in effects  # the default estimate, before history
    assert core.accounts["alice"].vtime == 2.0
    effects = core.on_complete(done(d, total_s=3.5, load_s=1.0), 1.0)
    assert ChargeVTime("alice", delta=1.5, service_s=3.5) in effects  # + measured - estimate
    assert core.accounts["alice"].vtime == 3.5 and core.accounts["alice"].service_s == 3.5
    # The next node is estimated from history: 2.5 s run (load counted separately) + 1.0 s load
    # unless the model is resident on the executor, which says it is not.
    (d2,) = [e for e in core.schedule(1.0) if isinstance(e, SendDispatch)]
    assert core.accounts["alice"].vtime == pytest.approx(3.5 + 2.5 + 1.0)
    core.on_complete(done(d2, total_s=2.0), 2.0)
    assert core.accounts["alice"].vtime == pytest.approx(5.5) and core.accounts["alice"].service_s == 5.5


def test_a_dispatch_the_executor_never_accepted_is_refunded():
    core = SchedulerCore(get_policy("fair"), estimator=Estimator(default_s=1.0))
    core.on_heartbeat(ExecutorHeartbeat("e1", "cpu", "shm", "s", ["f.a"]), 0.0)
    core.add_request(ImageRequest("r1", "alice", "w", 1, {}, 0.0), chain(1), attempt=1, now=0.0)
    (d,) = [e for e in core.schedule(0.0) if isinstance(e, SendDispatch)]
    effects = core.dispatch_result(d.msg.ref, "e1", ok=False, seq=0, error="no responders", now=0.1)
    assert ChargeVTime("alice", delta=-1.0, ops=-1) in effects
    assert core.accounts["alice"].vtime == 0.0 and core.accounts["alice"].ops == 0


def test_parallel_nodes_of_one_request_are_each_charged():
    core = SchedulerCore(get_policy("fair"), estimator=Estimator(default_s=1.0))
    for e in ("e1", "e2"):
        core.on_heartbeat(ExecutorHeartbeat(e, "cpu", "shm", "s", ["f.a", "f.b"]), 0.0)
    a = DagNode("base", "f.a", "m", {}, frozenset(), ("y",), frozenset(), 0)
    b = DagNode("control", "f.b", "m", {}, frozenset(), ("y",), frozenset(), 1)
    dag = Dag(
        {"base": a, "control": b},
        {"i": TensorSource("base", "y"), "j": TensorSource("control", "y")},
        {},
        {"base": [], "control": []},
    )
    core.add_request(ImageRequest("r1", "alice", "w", 1, {}, 0.0), dag, attempt=1, now=0.0)
    assert len([e for e in core.schedule(0.0) if isinstance(e, SendDispatch)]) == 2
    assert core.accounts["alice"].vtime == 2.0 and core.accounts["alice"].ops == 2


def test_a_tenant_returning_after_inactivity_is_lifted_in_the_core():
    core = SchedulerCore(get_policy("fair", 0.0), estimator=Estimator(default_s=1.0), accounts=Accounts())
    core.accounts.load({"old": 1.0, "busy": 40.0})
    core.on_heartbeat(ExecutorHeartbeat("e1", "cpu", "shm", "s", ["f.a"]), 0.0)
    core.add_request(ImageRequest("b1", "busy", "w", 1, {}, 0.0), chain(3), attempt=1, now=0.0)
    (d,) = [e for e in core.schedule(0.0) if isinstance(e, SendDispatch)]  # busy is settled and active
    core.add_request(ImageRequest("o1", "old", "w", 1, {}, 0.0), chain(1), attempt=1, now=0.5)
    assert core.accounts["old"].returning and core.accounts["old"].vtime == 1.0
    effects = core.on_complete(done(d, total_s=1.5), 1.0)  # busy: 40 + 1.5 measured
    effects = core.schedule(1.0)  # Algorithm 1 runs when an executor is idle: lift, then dispatch
    assert ChargeVTime("old", set_vtime=41.5) in effects
    (d2,) = [e for e in effects if isinstance(e, SendDispatch)]
    assert d2.msg.request_id == "o1"  # at 41.5 = busy's 41.5, and its node waited longer
    assert not core.accounts["old"].returning


def test_the_operator_view_counts_each_tenants_work():
    core = SchedulerCore(get_policy("fair"), estimator=Estimator(default_s=1.0))
    core.on_heartbeat(ExecutorHeartbeat("e1", "cpu", "shm", "s", ["f.a"]), 0.0)
    for i in range(3):
        core.add_request(ImageRequest(f"r{i}", "alice", "w", 1, {}, 0.0), chain(2), attempt=1, now=0.0)
    core.schedule(0.0)
    v = core.tenant_stats()["alice"]
    assert v["requests"] == 3 and v["running_nodes"] == 1 and v["queued"] == 2 and v["ready_nodes"] == 2
    assert v["vtime_s"] == 1.0 and v["ops"] == 1


def test_shape_keys_are_order_independent():
    assert shape_key([("b", [1, 2]), ("a", [3])]) == shape_key([("a", [3]), ("b", [1, 2])]) == "a=3;b=1x2"
