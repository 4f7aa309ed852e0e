"""What the core shows its policy: each ready node and each idle executor as the immutable values of
:mod:`services.scheduler.core.snapshot`, with the estimates the node would be charged. Functions of the
core's state, with no I/O; the only state they write is their own memo of a node's input shapes
(``RequestRun.shape_keys``, see :func:`input_shapes`). The core calls them when it builds a
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

    Kept per node while the metadata of its inputs is the same (the same objects): every
    snapshot asks it of every ready node, and building the key was a tenth of the scheduler's
    time under load (docs/scheduling.md, "Control-plane speed")."""
    node = run.dag.nodes[node_id]
    tensors = run.tensors
    present = tuple(tensors.get(src) for src in node.inputs.values() if isinstance(src, TensorSource))
    hit = run.shape_keys.get(node_id)
    if (
        hit is not None
        and len(hit[0]) == len(present)
        and all(a is b for a, b in zip(hit[0], present, strict=True))
    ):
        return hit[1]
    key = shape_key(
        (name, [d for m in metas_of(tensors[src]) for d in m.shape])
        for name, src in node.inputs.items()
        if isinstance(src, TensorSource) and src in tensors
    )
    run.shape_keys[node_id] = (present, key)
    return key


def ready_node(run: RequestRun, rec: NodeRecord, estimator: Estimator, kind: str | None) -> ReadyNode:
    """A ready node as the policy sees it: where its inputs are, and its estimated times on
    executors of ``kind`` (any kind when None)."""
    node = rec.node
    tensors = run.tensors
    inputs = tuple(
        (m.executor, m.nbytes)
        for s in node.inputs.values()
        if isinstance(s, TensorSource) and s in tensors
        for m in metas_of(tensors[s])
    )
    return ReadyNode(
        ref=rec.ref,
        tenant=run.req.tenant,
        fn=node.fn,
        model=node.model,
        order=node.order,
        submitted_at=run.arrived,
        ready_since=rec.ready_since,
        inputs=inputs,
        est_s=estimator.estimate(node.fn, node.model, input_shapes(run, node.id), kind),
        load_s=estimator.load_estimate(node.fn, node.model, kind),
        load_host_s=estimator.load_estimate(node.fn, node.model, kind, tier="host"),
        remaining_s=rec.critical_s,
        job_s=run.job_s,
    )


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
