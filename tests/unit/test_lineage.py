"""Lineage re-execution (``services/scheduler/core/lineage.py``): losing an executor re-runs, within the
same attempt, only the nodes whose work was lost, on hand-built DAGs driven through the core."""

from __future__ import annotations

import pytest

from libs.protocol.ids import AttemptRef, NodeRef
from libs.protocol.messages import (
    CancelNode,
    ExecutorHeartbeat,
    NodeFailed,
    PendingInput,
    TensorInput,
)
from libs.workflow.dag import Const, Dag, DagNode, TensorSource
from services.scheduler.core import lineage
from services.scheduler.core.effects import (
    ChargeVTime,
    Finished,
    PersistRequest,
    ReleaseAttempt,
    SendCallback,
    SendCancel,
    SendDispatch,
)
from services.scheduler.core.errors import IllegalTransition
from services.scheduler.core.lifecycle import NodeState, NodeTable
from services.scheduler.core.policy import fifo
from services.scheduler.core.scheduling import SchedulerCore
from tests.unit.test_scheduler_core import complete, control_dag, dispatches, request

W, R, D, RUN, DONE = (
    NodeState.WAITING,
    NodeState.READY,
    NodeState.DISPATCHED,
    NodeState.RUNNING,
    NodeState.DONE,
)


def pipeline_dag() -> Dag:
    """A text encoder, three denoising steps, a VAE; ``cond`` (say a pooled embedding) is read only
    by the last step and the VAE, so it survives a loss of the early steps' tensors."""
    emb, cond = TensorSource("enc", "emb"), TensorSource("cond", "pooled")

    def node(nid, fn, inputs, outputs, order):
        deps = frozenset(s.node for s in inputs.values() if isinstance(s, TensorSource))
        return DagNode(nid, fn, "m", inputs, frozenset(), outputs, deps, order)

    nodes = [
        node("enc", "enc", {"prompt": Const("p")}, ("emb",), 0),
        node("cond", "enc", {"prompt": Const("p")}, ("pooled",), 1),
        node("s0", "den", {"emb": emb}, ("lat",), 2),
        node("s1", "den", {"emb": emb, "lat": TensorSource("s0", "lat")}, ("lat",), 3),
        node("s2", "den", {"emb": emb, "lat": TensorSource("s1", "lat"), "cond": cond}, ("lat",), 4),
        node("vae", "vae", {"lat": TensorSource("s2", "lat"), "cond": cond}, ("image",), 5),
    ]
    by_id = {n.id: n for n in nodes}
    consumers: dict[TensorSource, int] = {}
    successors: dict[str, list[str]] = {n.id: [] for n in nodes}
    for n in nodes:
        for s in n.inputs.values():
            if isinstance(s, TensorSource):
                consumers[s] = consumers.get(s, 0) + 1
        for d in sorted(n.deps):
            successors[d].append(n.id)
    return Dag(
        by_id, {"image": TensorSource("vae", "image")}, consumers, successors, {n.id: [] for n in nodes}
    )


FNS = ["enc", "den", "vae", "toy.encode", "toy.prepare", "toy.control", "toy.controlled_denoiser"]
FNS += ["toy.step", "toy.decode"]


def beat(ex: str, seq: int = 1) -> ExecutorHeartbeat:
    return ExecutorHeartbeat(ex, "cpu", "shm", f"seg-{ex}", FNS, seq=seq)


def core_with(*executors: str, **kw) -> SchedulerCore:
    core = SchedulerCore(fifo, heartbeat_timeout_s=1e9, node_time_limit_s=0.0, **kw)
    for e in executors:
        core.on_heartbeat(beat(e), 0.0)
    return core


def on(core: SchedulerCore, ex: str, now: float = 0.0) -> list[SendDispatch]:
    """Schedule with only ``ex`` idle: place the next ready node there."""
    others = [e for e in core.executors.values() if e.id != ex and not e.suspect]
    for e in others:
        e.suspect = True
    try:
        return dispatches(core.schedule(now))
    finally:
        for e in others:
            e.suspect = False


def run_on(core: SchedulerCore, ex: str, now: float = 0.0) -> tuple[SendDispatch, list]:
    (d,) = on(core, ex, now)
    return d, core.on_complete(complete(d), now)


def finish(core: SchedulerCore, now: float = 10.0) -> tuple[list[str], Finished]:
    """Run everything that is left, every dispatch completing at once; the nodes run, in order."""
    ran, done = [], []
    pending = dispatches(core.schedule(now))
    while pending:
        d = pending.pop(0)
        ran.append(d.msg.node_id)
        done += [e for e in core.on_complete(complete(d), now) if isinstance(e, Finished)]
        pending += dispatches(core.schedule(now))
    (f,) = done
    return ran, f


def states(core: SchedulerCore, rid: str = "r1") -> dict[str, NodeState]:
    return {nid: rec.state for nid, rec in core.runs[rid].nodes.records.items()}


def assert_consistent(core: SchedulerCore, rid: str = "r1") -> None:
    """The attempt's bookkeeping as if the current states had been reached without a loss."""
    run = core.runs[rid]
    recs = run.nodes.records
    for nid, rec in recs.items():
        if rec.state in (W, R):
            assert rec.deps_left == sum(1 for p in rec.node.deps if recs[p].state is not DONE), nid
        if rec.state is R:  # every input it reads exists
            ins = rec.node.inputs.items()
            assert all(
                s in run.tensors
                for n, s in ins
                if isinstance(s, TensorSource) and n not in rec.node.callbacks
            )
    for src in run.dag.consumers:
        readers = sum(
            1 for rec in recs.values() if rec.state is not DONE for s in rec.node.inputs.values() if s == src
        )
        assert run.reads_left[src] == readers, src
        assert (src in run.tensors) == (recs[src.node].state is DONE), src
    assert run.nodes.done == sum(1 for rec in recs.values() if rec.state is DONE)


def persisted(effects) -> list[PersistRequest]:
    return [e for e in effects if isinstance(e, PersistRequest)]


def charges(effects) -> list[ChargeVTime]:
    return [e for e in effects if isinstance(e, ChargeVTime)]


# -- which nodes run again -------------------------------------------------------------------------------
def test_losing_the_executor_of_a_middle_tensor_reruns_its_lineage_in_the_same_attempt():
    core = core_with("e1", "e2")
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e1")  # enc
    run_on(core, "e1")  # cond
    run_on(core, "e1")  # s0
    d, _ = run_on(core, "e2")  # s1: its latents live on e2 only
    assert d.msg.node_id == "s1"
    effects = core.remove_executor("e2", 1.0, "test")
    run = core.runs["r1"]
    assert run.attempt == 1 and not [e for e in effects if isinstance(e, ReleaseAttempt)]
    # s1 runs again; its inputs were released by its first run (emb) or freed (s0's latents), so their
    # producers run again too, back to the root. cond survives on e1 and is read only by nodes that
    # have not run: it is not run again.
    assert states(core) == {"enc": R, "cond": DONE, "s0": W, "s1": W, "s2": W, "vae": W}
    assert run.reruns == 3 and TensorSource("cond", "pooled") in run.tensors
    assert_consistent(core)
    # Redis: the attempt's tensor metadata is dropped and what is left written back.
    drop, keep = persisted(effects)
    assert drop.drop_tensors and not drop.tensors and drop.fields["attempt"] == 1
    assert "executor e2 lost" in str(drop.fields["recovered"])
    assert list(keep.tensors) == [NodeRef("r1", 1, "cond").output("pooled").encode()]
    assert not keep.drop_tensors
    # The rerun of enc stores its output for the two readers left (s0 and s1 read it again, s2 never did).
    (again,) = on(core, "e1", 2.0)
    assert again.msg.node_id == "enc" and [(o.name, o.consumers) for o in again.msg.outputs] == [("emb", 3)]
    core.on_complete(complete(again), 2.0)
    ran, f = finish(core)
    assert ran == ["s0", "s1", "s2", "vae"]
    assert f.result.status == "succeeded" and f.result.images["image"].name == "r1/image.png"
    assert f.result.executors == ["e1", "e2"] and core.active == 0


def test_an_executor_holding_only_a_shared_input_costs_only_that_producer_and_its_running_reader():
    core = core_with("e1", "e2")
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e2")  # enc: emb, read by every step, lives on e2
    run_on(core, "e1")  # cond
    run_on(core, "e1")  # s0
    run_on(core, "e1")  # s1
    (s2,) = on(core, "e1")  # s2 runs on e1 and was given emb's metadata (on e2)
    assert s2.msg.node_id == "s2"
    effects = core.remove_executor("e2", 1.0, "test")
    # s2 cannot read emb: it is cancelled on e1 and waits for the encoder to run again; s0 and s1,
    # whose outputs (s1's latents, on e1) survive, do not run again.
    assert [e for e in effects if isinstance(e, SendCancel)] == [SendCancel("e1", CancelNode("r1", 1, "s2"))]
    assert states(core) == {"enc": R, "cond": DONE, "s0": DONE, "s1": DONE, "s2": W, "vae": W}
    assert core.runs["r1"].nodes["s2"].retries == 0  # the loss is no failed try of s2
    assert_consistent(core)
    # e1 is busy until s2's cancellation is answered (stale: s2 was put back).
    assert on(core, "e1") == []
    core.on_failed(NodeFailed("e1", "r1", 1, "s2", "cancelled by the scheduler", True), 1.1)
    (enc,) = on(core, "e1", 1.2)
    assert enc.msg.node_id == "enc" and [(o.name, o.consumers) for o in enc.msg.outputs] == [("emb", 1)]
    core.on_complete(complete(enc), 1.3)
    ran, f = finish(core)
    assert ran == ["s2", "vae"] and f.result.status == "succeeded"


def test_a_lost_tensor_no_one_reads_any_more_costs_nothing():
    core = core_with("e1", "e2")
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e1")  # enc
    run_on(core, "e1")  # cond
    run_on(core, "e2")  # s0: its latents on e2 ...
    run_on(core, "e1")  # s1: ... are read: freed
    assert core.remove_executor("e2", 1.0, "test") == []
    assert core.runs["r1"].reruns == 0 and core.runs["r1"].nodes.done == 4
    ran, f = finish(core)
    assert ran == ["s2", "vae"] and f.result.status == "succeeded"


def test_a_node_running_on_the_lost_executor_is_ready_again_and_not_a_failed_try():
    core = core_with("e1", "e2", max_node_retries=0)
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e1")  # enc
    (cond,) = on(core, "e2")
    effects = core.remove_executor("e2", 1.0, "test")
    assert states(core)["cond"] is R and core.runs["r1"].nodes["cond"].retries == 0
    assert not [e for e in effects if isinstance(e, SendCancel)]  # nothing to cancel on a lost executor
    assert core.runs["r1"].reruns == 0
    ran, f = finish(core)
    assert ran == ["cond", "s0", "s1", "s2", "vae"] and f.result.status == "succeeded"


def test_a_second_loss_during_the_re_execution_is_recovered_too():
    core = core_with("e1", "e2", "e3")
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e1")  # enc
    run_on(core, "e1")  # cond
    run_on(core, "e1")  # s0
    run_on(core, "e2")  # s1
    core.remove_executor("e2", 1.0, "first")
    run_on(core, "e3", 2.0)  # enc again, on e3
    run_on(core, "e3", 2.0)  # s0 again, on e3
    (s1,) = on(core, "e1", 2.0)  # s1 again, on e1, reading emb and s0's latents from e3
    assert s1.msg.node_id == "s1"
    assert {i.meta.executor for i in s1.msg.inputs.values() if isinstance(i, TensorInput)} == {"e3"}
    effects = core.remove_executor("e3", 3.0, "second")
    assert [e for e in effects if isinstance(e, SendCancel)] == [SendCancel("e1", CancelNode("r1", 1, "s1"))]
    assert states(core) == {"enc": R, "cond": DONE, "s0": W, "s1": W, "s2": W, "vae": W}
    assert core.runs["r1"].attempt == 1 and core.runs["r1"].reruns == 5  # 3, then enc and s0 again
    assert_consistent(core)
    core.on_failed(NodeFailed("e1", "r1", 1, "s1", "cancelled by the scheduler", True), 3.1)
    ran, f = finish(core)
    assert ran == ["enc", "s0", "s1", "s2", "vae"] and f.result.status == "succeeded"
    assert f.result.executors == ["e1", "e2", "e3"]


def test_a_reader_that_finds_its_producer_unreachable_triggers_the_recovery_at_once():
    core = core_with("e1", "e2")
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e2")  # enc
    run_on(core, "e1")  # cond
    (s0,) = on(core, "e1")
    failed = NodeFailed("e1", "r1", 1, "s0", "peer gone", retryable=True, unreachable="e2")
    effects = core.on_failed(failed, 0.5)
    assert "e2" not in core.executors and core.runs["r1"].attempt == 1
    assert not [e for e in effects if isinstance(e, SendCancel)]  # s0 already ended on e1
    assert states(core) == {"enc": R, "cond": DONE, "s0": W, "s1": W, "s2": W, "vae": W}
    assert core.runs["r1"].nodes["s0"].retries == 0
    ran, f = finish(core)
    assert ran == ["enc", "s0", "s1", "s2", "vae"] and f.result.status == "succeeded"


# -- accounting --------------------------------------------------------------------------------------
def test_the_tenant_is_charged_each_node_once_and_the_platform_pays_for_what_it_lost():
    core = core_with("e1", "e2")
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e1")  # enc
    run_on(core, "e1")  # cond
    run_on(core, "e1")  # s0
    run_on(core, "e2")  # s1
    (s2,) = on(core, "e2")  # in flight on e2 when it is lost: its estimate is refunded
    estimate = core.runs["r1"].nodes["s2"].charge_s
    ops = core.accounts["t1"].ops
    effects = core.remove_executor("e2", 1.0, "test")
    assert charges(effects) == [ChargeVTime("t1", delta=-estimate, ops=-1)]
    assert core.accounts["t1"].ops == ops - 1
    (enc,) = on(core, "e1", 2.0)
    assert not charges(core.on_complete(complete(enc), 2.0))  # a rerun: nothing charged, nothing corrected
    ran, f = finish(core)
    acct = core.accounts["t1"]
    nodes = len(pipeline_dag().nodes)
    assert acct.service_s == pytest.approx(0.5 * nodes)  # every node's measured time, once
    assert acct.vtime == pytest.approx(0.5 * nodes) and acct.ops == nodes
    # enc, s0 and s1 ran twice: the result reports what the tenant was charged (each node once)
    assert f.result.gpu_s == pytest.approx(0.5 * nodes) == pytest.approx(acct.vtime)
    assert f.result.nodes_run == nodes


def test_a_rerun_whose_dispatch_is_refused_is_not_refunded():
    core = core_with("e1", "e2")
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e2")  # enc
    core.remove_executor("e2", 1.0, "test")
    vtime = core.accounts["t1"].vtime
    (d,) = on(core, "e1", 2.0)
    effects = core.dispatch_result(d.msg.ref, "e1", ok=False, seq=0, error="no responders", now=2.1)
    assert not charges(effects) and core.accounts["t1"].vtime == vtime
    assert core.runs["r1"].nodes["enc"].rerun and states(core)["enc"] is R


# -- callback inputs (paper §5.2) ----------------------------------------------------------------------
def through_roots(core: SchedulerCore) -> None:
    run_on(core, "e1")  # encode
    run_on(core, "e1")  # prepare


def test_a_base_model_waiting_for_a_lost_controlnet_keeps_waiting_and_gets_the_rerun_forwarded():
    core = core_with("e1", "e2", "e3")
    core.add_request(request(), control_dag(), attempt=1, now=0.0)
    through_roots(core)
    (ctl,) = on(core, "e2", 1.0)
    (base,) = on(core, "e3", 1.0)
    assert base.msg.inputs["control_outputs"] == PendingInput("control@0", "control_outputs")
    effects = core.remove_executor("e2", 1.5, "test")
    assert not [e for e in effects if isinstance(e, SendCancel)]  # it has nothing of e2's yet
    assert states(core)["control@0"] is R and states(core)["controlled_denoiser@0"] is D
    (again,) = on(core, "e1", 2.0)
    assert again.msg.node_id == "control@0"
    (fwd,) = [e for e in core.on_complete(complete(again), 2.5) if isinstance(e, SendCallback)]
    assert fwd.executor == "e3" and fwd.msg.meta.executor == "e1"
    core.on_complete(complete(base), 3.0)
    ran, f = finish(core)
    assert f.result.status == "succeeded" and "control@0" not in ran


def test_a_base_model_given_a_lost_control_output_is_cancelled_and_held_back_until_the_rerun_starts():
    core = core_with("e1", "e2", "e3")
    core.add_request(request(), control_dag(), attempt=1, now=0.0)
    through_roots(core)
    (ctl,) = on(core, "e2", 1.0)
    (base,) = on(core, "e3", 1.0)
    core.on_complete(complete(ctl), 1.2)  # forwarded to the base model on e3
    effects = core.remove_executor("e2", 1.5, "test")
    assert [e for e in effects if isinstance(e, SendCancel)] == [
        SendCancel("e3", CancelNode("r1", 1, "controlled_denoiser@0"))
    ]
    # control@0 runs again; it reads prepare's latents and encode's embeddings again, so they are made
    # again too; the base model waits for both its ordinary inputs and its ControlNet to start.
    st = states(core)
    assert st["control@0"] is W and st["controlled_denoiser@0"] is W
    base_rec = core.runs["r1"].nodes["controlled_denoiser@0"]
    assert base_rec.cb_waiting == {"control@0"} and base_rec.deps_left == 2
    assert_consistent(core)
    core.on_failed(
        NodeFailed("e3", "r1", 1, "controlled_denoiser@0", "cancelled by the scheduler", True), 1.6
    )
    run_on(core, "e1", 2.0)  # encode
    run_on(core, "e1", 2.0)  # prepare
    assert states(core)["controlled_denoiser@0"] is W  # its ControlNet has not started
    (again,) = on(core, "e1", 2.0)
    assert again.msg.node_id == "control@0" and states(core)["controlled_denoiser@0"] is R
    core.on_complete(complete(again), 2.5)
    ran, f = finish(core)
    assert ran[0] == "controlled_denoiser@0" and f.result.status == "succeeded"


def test_a_ready_base_model_is_held_back_when_its_finished_controlnet_runs_again():
    core = core_with("e1", "e2")
    core.add_request(request(), control_dag(), attempt=1, now=0.0)
    through_roots(core)
    run_on(core, "e2", 1.0)  # control@0, done; its output on e2
    assert states(core)["controlled_denoiser@0"] is R
    core.remove_executor("e2", 1.5, "test")
    rec = core.runs["r1"].nodes["controlled_denoiser@0"]
    assert rec.state is W and "control@0" in rec.cb_waiting
    ran, f = finish(core)
    assert ran.index("control@0") < ran.index("controlled_denoiser@0") and f.result.status == "succeeded"


# -- fallback ----------------------------------------------------------------------------------------
def test_a_recovery_the_table_cannot_carry_out_falls_back_to_a_restart_within_max_restarts(monkeypatch):
    core = core_with("e1", "e2", max_restarts=1)
    core.add_request(request(), pipeline_dag(), attempt=1, now=0.0)
    run_on(core, "e2")  # enc
    bogus = lineage.Recovery("e2", (), ("s0",), frozenset())  # s0 never ran: cannot be undone
    monkeypatch.setattr(lineage, "plan", lambda run, ex: bogus)
    assert lineage.unrepresentable(core.runs["r1"], bogus) == "node s0 is ready, not done"
    effects = core.remove_executor("e2", 1.0, "test")
    assert ReleaseAttempt(AttemptRef("r1", 1)) in effects and core.runs["r1"].attempt == 2
    core.on_heartbeat(beat("e2", seq=2), 2.0)
    effects = core.remove_executor("e2", 3.0, "again")
    (f,) = [e for e in effects if isinstance(e, Finished)]
    assert f.result.error_code == "internal" and "gave up after 1 restarts" in f.result.error


# -- the transition ----------------------------------------------------------------------------------
def table() -> NodeTable:
    return NodeTable(AttemptRef("r1", 1), pipeline_dag(), {}, 0.0)


def done(t: NodeTable, *nids: str) -> None:
    for nid in nids:
        t.dispatch(nid, "e1", 0.0, charge_s=1.0, shapes="", kind="cpu")
        t.complete(nid, 0.0)


def test_undo_takes_a_done_node_back_and_its_consumers_wait_for_it_again():
    t = table()
    done(t, "enc", "s0")
    assert t["s1"].state is R
    rec = t.undo("s0", 5.0)
    assert (rec.state, rec.rerun, rec.ready_since) == (R, True, 5.0)  # its input (emb) exists
    assert t["s1"].state is W and t["s1"].deps_left == 1 and t.done == 1 and "s1" not in t.ready
    t.undo("enc", 6.0)
    assert t["s0"].state is W and t["s0"].deps_left == 1 and t["enc"].state is R
    done(t, "enc")
    assert not t["enc"].rerun and t["s0"].state is R


def test_undo_refuses_a_node_that_is_not_done_or_whose_reader_is_in_flight_and_changes_nothing():
    t = table()
    with pytest.raises(IllegalTransition):
        t.undo("enc", 1.0)
    done(t, "enc")
    t.dispatch("s0", "e1", 0.0, charge_s=1.0, shapes="", kind="cpu")
    before = ({n: r.state for n, r in t.records.items()}, list(t.ready), t.done)
    with pytest.raises(IllegalTransition) as err:
        t.undo("enc", 1.0)
    assert err.value.node.node_id == "s0" and err.value.from_state is D
    assert ({n: r.state for n, r in t.records.items()}, list(t.ready), t.done) == before
