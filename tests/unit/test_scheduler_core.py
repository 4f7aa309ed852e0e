"""The scheduler's state machine and FIFO/best-fit policy, driven by hand-built events (no broker)."""

from __future__ import annotations

import pytest

from libs.protocol.ids import AttemptRef, ModelKey, NodeRef, TensorRef
from libs.protocol.messages import (
    ConstInput,
    ExecutorHeartbeat,
    ImageRef,
    ImageRequest,
    NodeComplete,
    NodeFailed,
    NodeTiming,
    TensorInput,
)
from libs.protocol.tensor_meta import TensorMeta
from libs.workflow.dag import Dag, DagNode, TensorSource, unroll
from libs.workflow.params import resolve_params
from libs.workflow.validate import validate_spec
from services.scheduler.core.effects import Finished, PersistRequest, ReleaseAttempt, SendDispatch
from services.scheduler.core.errors import IllegalTransition
from services.scheduler.core.lifecycle import NodeState, NodeTable
from services.scheduler.core.policy import fifo
from services.scheduler.core.scheduling import SchedulerCore
from services.scheduler.core.snapshot import ExecutorInfo, ReadyNode, Snapshot, best_fit
from tests.support.toyfns import CATALOG
from tests.unit.test_workflow_dag import compose_toy

FNS = list(CATALOG)
OUTPUTS = {k: tuple(v.outputs) for k, v in CATALOG.items()}


def toy_dag(steps: int = 2):
    spec = validate_spec(compose_toy(), CATALOG)
    return unroll(
        spec, resolve_params(spec, {"prompt": "p", "num_inference_steps": steps}), outputs_of=OUTPUTS
    )


def request(rid: str = "r1", tenant: str = "t1", timeout_s: float = 60.0) -> ImageRequest:
    return ImageRequest(rid, tenant, "toy", 1, {"prompt": "p"}, submitted_at=0.0, timeout_s=timeout_s)


def hb(
    ex: str, seq: int = 1, running: list[str] | None = None, resident: list[str] | None = None
) -> ExecutorHeartbeat:
    return ExecutorHeartbeat(
        ex, "cpu", "shm", f"seg-{ex}", FNS, resident=resident or [], running=running or [], seq=seq
    )


def dispatches(effects) -> list[SendDispatch]:
    return [e for e in effects if isinstance(e, SendDispatch)]


def complete(d: SendDispatch, nbytes: int = 100, bytes_in: int = 0) -> NodeComplete:
    m = d.msg
    outputs = {
        o.name: TensorMeta(
            m.ref.output(o.name).encode(),
            d.executor,
            "shm",
            f"seg-{d.executor}",
            0,
            nbytes,
            "uint8",
            [nbytes],
        )
        for o in m.outputs
        if o.consumers
    }
    sinks = {o.name: ImageRef("b", o.sink, 10, 8, 8) for o in m.outputs if o.sink}
    return NodeComplete(
        d.executor, m.request_id, m.attempt, m.node_id, outputs, sinks, NodeTiming(exec_s=0.5), bytes_in
    )


def drive(core: SchedulerCore, now: float = 0.0, fail_on=None) -> list:
    """Run the core until no more dispatches: every dispatch completes immediately."""
    effects_all = []
    pending = dispatches(core.schedule(now))
    while pending:
        d = pending.pop(0)
        effects = core.on_complete(complete(d, bytes_in=7), now)
        effects_all += effects
        pending += dispatches(core.schedule(now))
    return effects_all


def test_a_request_runs_every_node_in_dependency_order_and_finishes_with_its_image():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.on_heartbeat(hb("e2"), 0.0)
    dag = toy_dag(steps=2)
    assert isinstance(core.add_request(request(), dag, attempt=1, now=0.0)[0], PersistRequest)
    first = dispatches(core.schedule(0.0))
    assert sorted(d.msg.node_id for d in first) == ["encode", "prepare"]  # both roots, in parallel
    assert {d.executor for d in first} == {"e1", "e2"}
    seen: list[str] = [d.msg.node_id for d in first]
    finished = []
    pending = first
    while pending:
        d = pending.pop(0)
        for inp in d.msg.inputs.values():
            if isinstance(inp, TensorInput):  # inputs carry the producer's metadata
                assert TensorRef.decode(inp.meta.tensor_id).node.node_id in seen
        effects = core.on_complete(complete(d, bytes_in=7), 1.0)
        finished += [e for e in effects if isinstance(e, Finished)]
        new = dispatches(core.schedule(1.0))
        seen += [n.msg.node_id for n in new]
        pending += new
    assert seen.index("decode") == len(seen) - 1
    assert seen.index("denoiser@1") > seen.index("step@0")
    (f,) = finished
    assert f.result.status == "succeeded"
    assert f.result.images["image"].name == "r1/image.png"
    assert f.result.nodes == len(dag.nodes) and f.result.bytes_moved == 7 * len(dag.nodes)
    assert core.active == 0 and core.stats()["idle_executors"] == 2


def test_dispatch_tells_each_output_how_many_readers_it_has_and_passes_constants():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(steps=3), attempt=1, now=0.0)
    d = dispatches(core.schedule(0.0))[0]
    assert d.msg.node_id == "encode" and d.msg.inputs == {"prompt": ConstInput("p")}
    assert [(o.name, o.consumers) for o in d.msg.outputs] == [("prompt_embeds", 3)]
    core.on_complete(complete(d), 0.0)
    d = dispatches(core.schedule(0.0))[0]
    assert d.msg.node_id == "prepare"
    assert {o.name: o.consumers for o in d.msg.outputs} == {"latents": 2, "timesteps": 3}


def test_best_fit_prefers_resident_model_then_local_inputs_then_least_loaded():
    ref = NodeRef("r", 1, "n")
    node = ReadyNode(ref, "t", "toy.denoiser", "m", 0, 0.0, 0.0, inputs=(("b", 100), ("c", 10)))
    a = ExecutorInfo("a", frozenset(FNS), resident=frozenset({ModelKey("toy.denoiser", "m")}), load=5.0)
    b = ExecutorInfo("b", frozenset(FNS), load=0.0)
    c = ExecutorInfo("c", frozenset(FNS), load=0.0)
    d = ExecutorInfo("d", frozenset(FNS), load=0.0)
    cannot = ExecutorInfo("x", frozenset({"toy.encode"}), resident=frozenset({ModelKey("toy.denoiser", "m")}))
    assert best_fit(node, [b, c, a, cannot]).id == "a"
    assert best_fit(node, [c, b, d]).id == "b"
    far = ReadyNode(ref, "t", "toy.denoiser", "m", 0, 0.0, 0.0)
    assert (
        best_fit(
            far, [ExecutorInfo("p", frozenset(FNS), load=2.0), ExecutorInfo("q", frozenset(FNS), load=1.0)]
        ).id
        == "q"
    )
    assert best_fit(far, [cannot]) is None


def test_fifo_serves_the_older_request_first():
    older = ReadyNode(NodeRef("r1", 1, "a"), "t", "toy.encode", "", 0, submitted_at=1.0, ready_since=5.0)
    newer = ReadyNode(NodeRef("r2", 1, "a"), "t", "toy.encode", "", 0, submitted_at=2.0, ready_since=2.0)
    snap = Snapshot(now=9.0, ready=(newer, older), idle=(ExecutorInfo("e", frozenset(FNS)),))
    assert [a.node for a in fifo(snap).assignments] == [older.ref]


def test_a_lost_completion_is_detected_from_a_later_heartbeat_and_the_node_reruns():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1", seq=1), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.dispatch_result(d.msg.ref, "e1", ok=True, seq=1, error="", now=0.0)
    assert core.on_heartbeat(hb("e1", seq=2, running=[d.msg.ref.encode()]), 1.0) == []  # still running
    assert dispatches(core.schedule(1.0)) == []
    core.on_heartbeat(hb("e1", seq=3, running=[]), 2.0)  # finished, but no completion arrived
    (again,) = dispatches(core.schedule(2.0))
    assert again.msg.ref == d.msg.ref


def test_losing_an_executor_reruns_what_it_held_in_the_same_attempt():
    core = SchedulerCore(fifo, heartbeat_timeout_s=3.0)
    core.on_heartbeat(hb("e1"), 0.0)
    core.on_heartbeat(hb("e2"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    first = dispatches(core.schedule(0.0))
    on_e1 = next(d for d in first if d.executor == "e1")
    core.on_complete(complete(on_e1), 0.5)
    core.on_heartbeat(hb("e2", seq=2, running=[d.msg.ref.encode() for d in first if d.executor == "e2"]), 2.0)
    effects = core.expire(4.0)  # e1 silent for 4 s > 3 s: its tensor is still needed
    assert not [e for e in effects if isinstance(e, ReleaseAttempt)]  # lineage re-execution (test_lineage.py)
    assert core.runs["r1"].attempt == 1 and core.runs["r1"].nodes[on_e1.msg.node_id].state is NodeState.READY
    assert "e1" not in core.executors
    # e2 is still computing the other root; it is unaffected and its completion counts.
    on_e2 = next(d for d in first if d.executor == "e2")
    core.on_complete(complete(on_e2), 4.5)
    assert core.runs["r1"].nodes[on_e2.msg.node_id].state is NodeState.DONE
    effects = drive(core, 5.0)
    (f,) = [e for e in effects if isinstance(e, Finished)]
    assert f.result.status == "succeeded" and f.result.executors == ["e1", "e2"]


def test_a_retryable_node_failure_retries_the_node_and_a_permanent_one_fails_the_request():
    core = SchedulerCore(fifo, max_node_retries=1)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.on_failed(NodeFailed("e1", "r1", 1, d.msg.node_id, "arena full", retryable=True), 0.1)
    (again,) = dispatches(core.schedule(0.1))
    assert again.msg.ref == d.msg.ref
    effects = core.on_failed(NodeFailed("e1", "r1", 1, d.msg.node_id, "boom", retryable=False), 0.2)
    (f,) = [e for e in effects if isinstance(e, Finished)]
    assert f.result.status == "failed" and "boom" in f.result.error and f.result.error_code == "workflow"
    assert ReleaseAttempt(AttemptRef("r1", 1)) in effects
    assert core.active == 0


def test_a_request_past_its_deadline_fails_with_a_timeout():
    core = SchedulerCore(fifo)
    core.add_request(request(timeout_s=10.0), toy_dag(), attempt=1, now=0.0)  # no executors at all
    assert core.expire(5.0) == []
    (f,) = [e for e in core.expire(11.0) if isinstance(e, Finished)]
    assert f.result.error_code == "timeout"


def test_an_unanswered_dispatch_puts_the_node_back_and_skips_the_executor_until_it_heartbeats():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.dispatch_result(d.msg.ref, "e1", ok=False, seq=0, error="no responders", now=0.1)
    assert dispatches(core.schedule(0.2)) == []  # e1 is suspect
    core.on_heartbeat(hb("e1", seq=2), 0.3)
    (again,) = dispatches(core.schedule(0.3))
    assert again.msg.ref == d.msg.ref


def test_an_executor_busy_with_work_this_scheduler_never_sent_is_not_given_more():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1", running=["old/1/x"]), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    assert dispatches(core.schedule(0.0)) == []
    core.on_heartbeat(hb("e1", seq=2), 1.0)
    assert len(dispatches(core.schedule(1.0))) == 1


def test_a_completion_missing_an_output_that_others_read_fails_the_request():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    bad = NodeComplete("e1", "r1", 1, d.msg.node_id, outputs={})
    (f,) = [e for e in core.on_complete(bad, 0.1) if isinstance(e, Finished)]
    assert f.result.status == "failed" and "returned no ['prompt_embeds']" in f.result.error


def test_a_node_that_cannot_read_a_dead_producers_tensor_reruns_the_producer_at_once():
    core = SchedulerCore(fifo, heartbeat_timeout_s=30.0)
    core.on_heartbeat(hb("e1"), 0.0)
    core.on_heartbeat(hb("e2"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    first = dispatches(core.schedule(0.0))
    for d in first:
        core.on_complete(complete(d), 0.1)
    consumer = next(d for d in dispatches(core.schedule(0.1)))
    producer = next(
        i.meta.executor
        for i in consumer.msg.inputs.values()
        if isinstance(i, TensorInput) and i.meta.executor != consumer.executor
    )
    failed = NodeFailed(
        consumer.executor, "r1", 1, consumer.msg.node_id, "peer gone", retryable=True, unreachable=producer
    )
    effects = core.on_failed(failed, 0.2)  # long before the heartbeat timeout
    assert ReleaseAttempt(AttemptRef("r1", 1)) not in effects
    assert core.runs["r1"].attempt == 1 and producer not in core.executors
    assert core.runs["r1"].nodes[consumer.msg.node_id].state is NodeState.WAITING  # for the rerun
    assert core.runs["r1"].nodes[consumer.msg.node_id].retries == 0
    (f,) = [e for e in drive(core, 0.3) if isinstance(e, Finished)]
    assert f.result.status == "succeeded" and consumer.executor in f.result.executors


# -- callback inputs (§5.2): a ControlNet in parallel with the base model -------------------------------
def control_dag(steps: int = 1):
    from libs.workflow.compose import Workflow
    from tests.support.toyfns import PARAMS, Control, ControlledDenoiser, Decode, Encode, Prepare, Step

    enc, prep, ctl, den, step, dec = Encode(), Prepare(), Control(), ControlledDenoiser(), Step(), Decode()
    with Workflow("ctl", params=PARAMS) as wf:
        enc()
        init = prep()

        def body(step, latents):
            control_outputs = ctl(latents=latents)
            noise_pred = den(latents=latents, control_outputs=control_outputs)
            return step_(noise_pred=noise_pred, latents=latents)

        step_ = step
        wf.output("image", dec(latents=wf.loop(steps, body, latents=init.latents)))
    spec = validate_spec(wf.spec(), CATALOG)
    return unroll(spec, resolve_params(spec, {"prompt": "p"}), outputs_of=OUTPUTS)


def run_roots(core, now=0.0):
    for d in dispatches(core.schedule(now)):
        core.on_complete(complete(d), now)


def test_a_base_model_starts_once_its_controlnet_has_started_and_gets_the_control_output_forwarded():
    from libs.protocol.messages import PendingInput
    from services.scheduler.core.effects import SendCallback

    core = SchedulerCore(fifo)
    for e in ("e1", "e2", "e3"):
        core.on_heartbeat(hb(e), 0.0)
    core.add_request(request(), control_dag(), attempt=1, now=0.0)
    run_roots(core)  # encode, prepare
    first = dispatches(core.schedule(1.0))
    assert [d.msg.node_id for d in first] == ["control@0"]  # the base model waits for it to start
    second = dispatches(core.schedule(1.0))
    (base,) = second
    assert base.msg.node_id == "controlled_denoiser@0" and base.executor != first[0].executor
    assert base.msg.inputs["control_outputs"] == PendingInput("control@0", "control_outputs")
    assert base.msg.callbacks == ["control_outputs"]
    effects = core.on_complete(complete(first[0]), 1.5)
    (fwd,) = [e for e in effects if isinstance(e, SendCallback)]
    assert fwd.executor == base.executor and fwd.msg.node_id == "controlled_denoiser@0"
    assert fwd.msg.input == "control_outputs"
    assert TensorRef.decode(fwd.msg.meta.tensor_id) == NodeRef("r1", 1, "control@0").output("control_outputs")
    core.on_complete(complete(base), 2.0)
    (step,) = dispatches(core.schedule(2.0))
    assert step.msg.node_id == "step@0"


def test_with_one_executor_the_base_model_runs_after_the_controlnet_with_its_output_in_hand():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), control_dag(), attempt=1, now=0.0)
    run_roots(core)
    run_roots(core)
    (ctl,) = dispatches(core.schedule(1.0))
    assert ctl.msg.node_id == "control@0" and dispatches(core.schedule(1.0)) == []  # no executor free
    core.on_complete(complete(ctl), 1.5)
    (base,) = dispatches(core.schedule(1.5))
    assert isinstance(base.msg.inputs["control_outputs"], TensorInput)  # no pending: fetched directly


def test_a_controlnet_that_could_not_be_dispatched_holds_its_base_model_back_again():
    core = SchedulerCore(fifo)
    for e in ("e1", "e2"):
        core.on_heartbeat(hb(e), 0.0)
    core.add_request(request(), control_dag(), attempt=1, now=0.0)
    run_roots(core)
    (ctl,) = dispatches(core.schedule(1.0))
    core.dispatch_result(ctl.msg.ref, ctl.executor, ok=False, seq=0, error="no responders", now=1.1)
    # The base model must not start on the other executor and wait for a ControlNet with no executor.
    (again,) = dispatches(core.schedule(1.2))
    assert again.msg.node_id == "control@0"


# -- the node lifecycle -----------------------------------------------------------------------------
def lifecycle_dag() -> Dag:
    """``p`` feeds ``c`` (an ordinary input) and ``k`` (a callback input, paper §5.2)."""
    p = DagNode("p", "f", "m", {}, frozenset(), ("y",), frozenset(), 0)
    c = DagNode("c", "f", "m", {"x": TensorSource("p", "y")}, frozenset(), ("y",), frozenset({"p"}), 1)
    k = DagNode(
        "k",
        "f",
        "m",
        {"x": TensorSource("p", "y")},
        frozenset({"x"}),
        ("y",),
        frozenset(),
        2,
        frozenset({"p"}),
    )
    return Dag(
        {"p": p, "c": c, "k": k},
        {"i": TensorSource("c", "y"), "j": TensorSource("k", "y")},
        {TensorSource("p", "y"): 2},
        {"p": ["c"], "c": [], "k": []},
        {"p": ["k"]},
    )


def table(now: float = 0.0) -> NodeTable:
    return NodeTable(AttemptRef("r1", 1), lifecycle_dag(), {"p": 3.0, "c": 1.0, "k": 1.0}, now)


def states(t: NodeTable) -> dict[str, NodeState]:
    return {nid: rec.state for nid, rec in t.records.items()}


W, R, D, RUN, DONE = (
    NodeState.WAITING,
    NodeState.READY,
    NodeState.DISPATCHED,
    NodeState.RUNNING,
    NodeState.DONE,
)


def test_a_node_goes_from_ready_to_dispatched_to_running_to_done_and_its_consumers_follow():
    t = table()
    assert states(t) == {"p": R, "c": W, "k": W} and list(t.ready) == ["p"]
    assert t["p"].ref == NodeRef("r1", 1, "p") and t["p"].critical_s == 3.0
    rec = t.dispatch("p", "e1", 1.0, charge_s=2.0, shapes="x=1", kind="cpu")
    assert (rec.state, rec.executor, rec.charge_s, rec.shapes, rec.kind) == (D, "e1", 2.0, "x=1", "cpu")
    # Its callback consumer may start once it has started; its ordinary consumer waits for its output.
    assert states(t) == {"p": D, "c": W, "k": R} and list(t.ready) == ["k"] and t["k"].ready_since == 1.0
    assert list(t.in_flight) == ["p"]
    assert t.accept("p").state is RUN
    t.complete("p", 2.0)
    assert states(t) == {"p": DONE, "c": R, "k": R} and t.done == 1 and not t.in_flight
    assert t["p"].executor is None and t["c"].deps_left == 0 and t["c"].ready_since == 2.0


def test_a_completion_may_overtake_the_acknowledgement_of_its_dispatch():
    t = table()
    t.dispatch("p", "e1", 0.0, charge_s=1.0, shapes="", kind="cpu")
    assert t.complete("p", 1.0).state is DONE


@pytest.mark.parametrize("acked", [False, True], ids=["dispatched", "running"])
def test_a_requeued_node_is_ready_again_and_holds_back_its_callback_consumers_that_have_not_started(acked):
    t = table()
    t.dispatch("p", "e1", 0.0, charge_s=1.0, shapes="", kind="cpu")
    if acked:
        t.accept("p")
    rec = t.requeue("p", 5.0, retry=True)
    assert (rec.state, rec.executor, rec.ready_since, rec.retries) == (R, None, 5.0, 1)
    assert states(t) == {"p": R, "c": W, "k": W} and t["k"].cb_waiting == {"p"}
    assert list(t.ready) == ["p"] and not t.in_flight
    t.dispatch("p", "e2", 6.0, charge_s=1.0, shapes="", kind="cpu")
    assert t.requeue("p", 7.0, retry=False).retries == 1  # a refused dispatch is no failed try


def test_a_callback_consumer_already_dispatched_is_not_held_back_when_its_producer_is_requeued():
    t = table()
    t.dispatch("p", "e1", 0.0, charge_s=1.0, shapes="", kind="cpu")
    t.dispatch("k", "e2", 0.0, charge_s=1.0, shapes="", kind="cpu")
    t.requeue("p", 1.0, retry=True)
    assert states(t) == {"p": R, "c": W, "k": D}


def test_hold_back_keeps_a_waiting_node_waiting_for_one_more_producer():
    t = table()
    assert t.hold_back("c", "p").state is W and t["c"].cb_waiting == {"p"}
    t.dispatch("p", "e1", 0.0, charge_s=1.0, shapes="", kind="cpu")
    assert t["k"].state is R
    assert t.hold_back("k", "p").state is W and "k" not in t.ready


def _done(t: NodeTable) -> None:
    t.dispatch("p", "e1", 0.0, charge_s=1.0, shapes="", kind="cpu")
    t.complete("p", 0.0)


ILLEGAL = {
    "completing a node that was never dispatched": (lambda t: None, lambda t: t.complete("p", 1.0), R, DONE),
    "completing a waiting node": (lambda t: None, lambda t: t.complete("c", 1.0), W, DONE),
    "dispatching a waiting node": (
        lambda t: None,
        lambda t: t.dispatch("c", "e", 1.0, charge_s=0, shapes="", kind=""),
        W,
        D,
    ),
    "dispatching a done node": (
        _done,
        lambda t: t.dispatch("p", "e", 1.0, charge_s=0, shapes="", kind=""),
        DONE,
        D,
    ),
    "completing a done node twice": (_done, lambda t: t.complete("p", 1.0), DONE, DONE),
    "accepting a node that was never dispatched": (lambda t: None, lambda t: t.accept("p"), R, RUN),
    "requeueing a ready node": (lambda t: None, lambda t: t.requeue("p", 1.0, retry=True), R, R),
    "requeueing a done node": (_done, lambda t: t.requeue("p", 1.0, retry=True), DONE, R),
    "holding back a dispatched node": (
        lambda t: t.dispatch("p", "e", 0.0, charge_s=0, shapes="", kind=""),
        lambda t: t.hold_back("p", "c"),
        D,
        W,
    ),
}


@pytest.mark.parametrize("case", list(ILLEGAL))
def test_an_illegal_transition_is_refused_and_changes_nothing(case):
    setup, transition, from_state, to_state = ILLEGAL[case]
    t = table()
    setup(t)
    before = (states(t), list(t.ready), list(t.in_flight), t.done)
    with pytest.raises(IllegalTransition) as err:
        transition(t)
    assert (err.value.from_state, err.value.to_state) == (from_state, to_state)
    assert err.value.node.request_id == "r1" and err.value.node.attempt == 1
    assert (states(t), list(t.ready), list(t.in_flight), t.done) == before


# -- the core around the lifecycle ------------------------------------------------------------------
def test_a_late_answer_to_a_first_dispatch_does_not_trip_up_the_retry_sent_to_the_same_executor():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)
    core.add_request(request(), toy_dag(), attempt=1, now=0.0)
    (d,) = dispatches(core.schedule(0.0))
    core.on_failed(NodeFailed("e1", "r1", 1, d.msg.node_id, "arena full", retryable=True), 0.1)
    (again,) = dispatches(core.schedule(0.1))
    assert again.executor == "e1" and again.msg.ref == d.msg.ref
    node = core.runs["r1"].nodes[d.msg.node_id]
    assert core.dispatch_result(d.msg.ref, "e1", ok=True, seq=1, error="", now=0.2) == []  # the first
    assert node.state is NodeState.RUNNING
    assert core.dispatch_result(d.msg.ref, "e1", ok=True, seq=2, error="", now=0.3) == []  # the retry
    assert node.state is NodeState.RUNNING
    core.on_complete(complete(again), 0.4)
    assert node.state is NodeState.DONE


def test_malformed_identifiers_in_a_heartbeat_are_logged_and_ignored(caplog):
    core = SchedulerCore(fifo)
    bad = hb("e1", resident=["toy.denoiser|m", "no-bar"], running=["not a node ref"])
    for seq in (1, 2):
        bad.seq = seq
        assert core.on_heartbeat(bad, float(seq)) == []
    ex = core.executors["e1"]
    assert ex.resident == {ModelKey("toy.denoiser", "m")} and ex.idle  # the bad running entry is ignored
    warnings = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1 and "no-bar" in warnings[0].getMessage()  # once, not every beat


def test_an_executors_reported_arena_reaches_placement():
    core = SchedulerCore(fifo)
    beat = hb("e1")
    beat.arena_capacity, beat.arena_free = 1000, 250
    core.on_heartbeat(beat, 0.0)
    (info,) = core.snapshot(0.0).idle
    assert (info.arena_capacity, info.arena_free) == (1000, 250)
