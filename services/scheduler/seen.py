"""What the core shows its policy: each ready node and each idle executor as the immutable values of
:mod:`services.scheduler.snapshot`, with the estimates the node would be charged. Pure functions
of the core's state; the core calls them when it builds a snapshot."""

from __future__ import annotations

from libs.workflow.dag import TensorSource
from services.scheduler.estimates import Estimator, shape_key
from services.scheduler.executors import ExecutorState
from services.scheduler.lifecycle import NodeRecord
from services.scheduler.records import RequestRun, metas_of
from services.scheduler.snapshot import ExecutorInfo, ReadyNode


def input_shapes(run: RequestRun, node_id: str) -> str:
    """The estimator's key for a node's tensor input shapes (as far as they are known)."""
    node = run.dag.nodes[node_id]
    return shape_key(
        (name, [d for m in metas_of(run.tensors[src]) for d in m.shape])
        for name, src in node.inputs.items()
        if isinstance(src, TensorSource) and src in run.tensors
    )


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


def executor_info(e: ExecutorState, now: float) -> ExecutorInfo:
    """An idle executor as the policy sees it: what it runs and holds, and how busy it was lately."""
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
