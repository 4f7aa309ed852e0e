"""What the core shows its policy: each ready node and each idle executor as the immutable values of
:mod:`services.scheduler.core.snapshot`, with the estimates the node would be charged. Functions of the
core's state, with no I/O; the only state they write is their own memos: of a node's input shapes
(``RequestRun.shape_keys``, see :func:`input_shapes`), of the value last built for a ready node
(``NodeRecord.view``) and for an idle executor (``ExecutorState.info_cache``). The core calls them when it builds a
snapshot."""

from __future__ import annotations

from libs.workflow.dag import TensorSource
from services.scheduler.core.estimates import Estimator, shape_key
from services.scheduler.core.executors import ExecutorState
from services.scheduler.core.lifecycle import NodeRecord
from services.scheduler.core.records import RequestRun, metas_of
from services.scheduler.core.snapshot import ExecutorInfo, ReadyNode


def input_shapes(run: RequestRun, node_id: str) -> str:
    """The estimator's key for a node's tensor input shapes (as far as they are known).

    Kept per node while the request's tensors are unchanged (``RequestRun.tensors_version``):
    every dispatch asks it, and building the key was a tenth of the scheduler's time under load
    (docs/scheduling.md, "Control-plane speed")."""
    hit = run.shape_keys.get(node_id)
    if hit is not None and hit[0] == run.tensors_version:
        return hit[1]
    tensors = run.tensors
    key = shape_key(
        (name, [d for m in metas_of(tensors[src]) for d in m.shape])
        for name, src in run.dag.nodes[node_id].inputs.items()
        if isinstance(src, TensorSource) and src in tensors
    )
    run.shape_keys[node_id] = (run.tensors_version, key)
    return key


# How long a ready node's snapshot value is reused while nothing about the node changed (its
# request's tensors, when it became ready, the executor kind its estimates are for): only its
# estimates can be older, by at most this much, as an idle executor's ``load`` is.
VIEW_REUSE_S = 0.05


def ready_node(
    run: RequestRun,
    rec: NodeRecord,
    estimator: Estimator,
    kind: str | None,
    now: float,
    memo: dict[tuple[str, str, str], tuple[float, float, float]] | None = None,
) -> ReadyNode:
    """A ready node as the policy sees it: where its inputs are, and its estimated times on
    executors of ``kind`` (any kind when None).

    Incremental: every round shows the policy every ready node, and with a few hundred of them
    building each anew was the largest part of a round (docs/scheduling.md, "Control-plane speed");
    the value built last is reused while the request's tensors are unchanged, the node has not
    left READY since, and its estimates are at most ``VIEW_REUSE_S`` old. ``memo``: the estimates
    already looked up for this snapshot, per (ModelFn, model, input shapes) (a snapshot's ready
    nodes share a few of those)."""
    v = rec.view
    if (
        v is not None
        and v[0] == run.tensors_version
        and v[1] == rec.ready_since
        and v[2] == kind
        and 0.0 <= now - v[3] <= VIEW_REUSE_S
    ):
        return v[4]
    node = rec.node
    shapes = input_shapes(run, node.id)
    key = (node.fn, node.model, shapes)
    est = None if memo is None else memo.get(key)
    if est is None:
        est = (
            estimator.estimate(node.fn, node.model, shapes, kind),
            estimator.load_estimate(node.fn, node.model, kind),
            estimator.load_estimate(node.fn, node.model, kind, tier="host"),
        )
        if memo is not None:
            memo[key] = est
    tensors = run.tensors
    inputs = tuple(
        (m.executor, m.nbytes)
        for s in node.inputs.values()
        if isinstance(s, TensorSource) and s in tensors
        for m in metas_of(tensors[s])
    )
    view = ReadyNode(
        ref=rec.ref,
        tenant=run.req.tenant,
        fn=node.fn,
        model=node.model,
        order=node.order,
        submitted_at=run.arrived,
        ready_since=rec.ready_since,
        inputs=inputs,
        est_s=est[0],
        load_s=est[1],
        load_host_s=est[2],
        remaining_s=rec.critical_s,
        job_s=run.job_s,
    )
    rec.view = (run.tensors_version, rec.ready_since, kind, now, view)
    return view


# How long a snapshot value of an executor with a decaying load is reused (its ``load`` is then
# off by at most 1 - 0.5 ** (INFO_REUSE_S / LOAD_HALF_LIFE_S), 0.35%: a tie-breaker's worth).
INFO_REUSE_S = 0.05


def executor_info(e: ExecutorState, now: float) -> ExecutorInfo:
    """An idle executor as the policy sees it: what it runs and holds, and how busy it was lately.

    Incremental: the value built last is reused while the executor has not changed (no report, no
    dispatch: ``ExecutorState.version``) and its load is 0 or was decayed to at most
    ``INFO_REUSE_S`` ago; with 256 executors, rebuilding every one per decision was the
    scheduler's largest cost (docs/scheduling.md, "Control-plane speed")."""
    c = e.info_cache
    if c is not None and c[0] == e.version and (e.load == 0.0 or 0.0 <= now - c[1] <= INFO_REUSE_S):
        return c[2]
    info = _executor_info(e, now)
    e.info_cache = (e.version, now, info)
    return info


def _executor_info(e: ExecutorState, now: float) -> ExecutorInfo:
    return ExecutorInfo(
        id=e.id,
        fns=e.fns,
        resident=e.resident,
        load=e.busy(now),
        arena_free=e.arena_free,
        kind=e.kind,
        arena_capacity=e.arena_capacity,
        host_resident=e.host_resident,
        cached=e.cached,
    )
