"""Lineage re-execution: what one attempt runs again when an executor is lost.

An executor takes two things with it: the nodes it was running, and the tensors in its arena.
Rather than start the request over as a new attempt, the core re-runs, within the same attempt,
only what the rest of the request still needs (the lineage of the lost tensors):

* Nodes in flight on the lost executor go back to READY (``requeue``, not a failed try).
* A DONE node one of whose outputs was on it and is still needed (``reads_left > 0``) is undone
  (``NodeTable.undo``) and runs again.
* A DONE node that runs again reads its inputs again, and **every** input is made again too: its
  producer is undone as well, back to the DAG's roots. Executors hold a tensor for exactly the
  reads still planned: every consumer releases its inputs at their producers when it completes
  (``services/executor/service.py``, ``_release_inputs``), and nothing takes a release back. So a
  tensor that survives on a live executor is held for its readers that have not run, not for a
  reader that completed and now runs again; that one reading it too would free it one read early
  and a later reader would find it gone. A surviving tensor is reused by the nodes that have not
  released it: those not yet run, and the in-flight nodes put back (a failed or cancelled run
  releases nothing). Reusing it for a node that runs again needs the executor to keep one more
  read for it (a protocol change; see docs/scheduling.md, "Lineage re-execution").
* Outputs of undone nodes and tensors that were on the lost executor are dropped from the
  attempt's tensors; a node in flight elsewhere that holds the metadata of one (an ordinary input,
  or a callback input already forwarded) is put back too, for the core to cancel. A callback
  consumer still waiting for an input (``pending``) keeps running: the producer's next completion
  is forwarded to it, as after any requeue.
* ``reads_left`` is counted afresh: per tensor, the inputs of nodes not DONE that read it.

The outputs of a node that runs again get the same tensor ids (same attempt, node and output);
executors replace an output they still hold under that id (``TensorStore.discard`` before ``put``).

Pure functions over a :class:`~services.scheduler.core.records.RequestRun`; the core turns a
:class:`Recovery` into effects (cancels, refunds, persisted state) and carries it out with
:func:`apply`. How the work that runs again is charged: ``docs/scheduling.md``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from libs.workflow.dag import DagNode, TensorSource
from services.scheduler.core.lifecycle import NodeRecord, NodeState
from services.scheduler.core.records import RequestRun, metas_of

__all__ = ["Recovery", "apply", "plan", "unrepresentable"]


@dataclass(frozen=True)
class Recovery:
    """What losing ``executor`` takes from one attempt, and what runs again."""

    executor: str
    reset: tuple[str, ...]  # in-flight nodes put back: on the lost executor, then readers elsewhere
    undo: tuple[str, ...]  # DONE nodes that run again, in topological order
    dropped: frozenset[TensorSource]  # tensors lost with the executor or to be made again

    @property
    def moved(self) -> tuple[str, ...]:
        """Every node whose state changes."""
        return self.reset + self.undo


def tensor_inputs(node: DagNode) -> list[TensorSource]:
    """Every tensor ``node`` reads, ordinary and callback inputs, once per input (as ``consumers``)."""
    return [src for src in node.inputs.values() if isinstance(src, TensorSource)]


def bound_inputs(rec: NodeRecord) -> list[TensorSource]:
    """The tensors an in-flight node was given the metadata of (not those it still waits for)."""
    return [
        src
        for name, src in rec.node.inputs.items()
        if isinstance(src, TensorSource) and name not in rec.pending
    ]


def plan(run: RequestRun, executor: str) -> Recovery | None:
    """What ``run`` must do again now that ``executor`` is gone; None when it lost nothing it needs."""
    nodes = run.nodes
    lost = frozenset(
        src for src, meta in run.tensors.items() if any(m.executor == executor for m in metas_of(meta))
    )
    on_lost = [nid for nid, rec in nodes.in_flight.items() if rec.executor == executor]
    todo = [src.node for src in lost if run.reads_left.get(src, 0) > 0]
    undo: set[str] = set()
    while todo:
        nid = todo.pop()
        if nid in undo or nodes[nid].state is not NodeState.DONE:
            continue  # already taken, or not made yet (in flight or waiting: it makes its outputs anyway)
        undo.add(nid)
        todo += [src.node for src in tensor_inputs(run.dag.nodes[nid])]  # all: see the module docstring
    if not undo and not on_lost:
        return None  # lost tensors no one reads any more: freed already, nothing to do
    dropped = lost | {src for src in run.tensors if src.node in undo}
    readers = [
        nid
        for nid, rec in nodes.in_flight.items()
        if rec.executor != executor and any(src in dropped for src in bound_inputs(rec))
    ]
    order = sorted(undo, key=lambda nid: run.dag.nodes[nid].order)
    return Recovery(executor, tuple(on_lost + readers), tuple(order), dropped)


def unrepresentable(run: RequestRun, recovery: Recovery) -> str | None:
    """Why the node table could not carry ``recovery`` out, or None when it can.

    ``plan`` only builds recoveries that pass (an ordinary consumer of a DONE node reads one of its
    outputs, which is then dropped, so it is put back first), so this finds a state the plan does
    not foresee, i.e. a bug elsewhere. Checked before anything changes, so the core can fall back
    to restarting the request instead of failing half-way through the transitions.
    """
    nodes, reset = run.nodes, set(recovery.reset)
    for nid in recovery.reset:
        if not nodes[nid].in_flight:
            return f"node {nid} is {nodes[nid].state.value}, not in flight"
    for nid in recovery.undo:
        if nodes[nid].state is not NodeState.DONE:
            return f"node {nid} is {nodes[nid].state.value}, not done"
        for s in run.dag.successors[nid]:
            if nodes[s].in_flight and s not in reset:
                return f"node {s} runs on {nodes[s].executor} without reading {nid}'s outputs"
    return None


def apply(run: RequestRun, recovery: Recovery, now: float) -> None:
    """Carry ``recovery`` out on ``run``: requeue, undo, drop the tensors, recount the reads."""
    nodes = run.nodes
    for nid in recovery.reset:  # first: ``undo`` refuses a node whose ordinary readers are in flight
        nodes.requeue(nid, now, retry=False)  # the executor's loss is no failed try of the node
    for nid in recovery.undo:
        nodes.undo(nid, now)
    for src in recovery.dropped:
        run.tensors.pop(src, None)
    run.tensors_version += 1
    reads = Counter(
        src
        for rec in nodes.records.values()
        if rec.state is not NodeState.DONE
        for src in tensor_inputs(rec.node)
    )
    run.reads_left = {src: reads[src] for src in run.dag.consumers}
    run.reruns += len(recovery.undo)
