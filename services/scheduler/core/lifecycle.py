"""The life of a node within one attempt at a request: one record per node, and named transitions.

| transition | from | to | when |
|---|---|---|---|
| (on its own) | WAITING | READY | its last ordinary input exists and every callback producer started |
| ``dispatch`` | READY | DISPATCHED | the policy placed it on an executor |
| ``accept`` | DISPATCHED | RUNNING | the executor acknowledged the dispatch |
| ``complete`` | DISPATCHED, RUNNING | DONE | its completion arrived |
| ``requeue`` | DISPATCHED, RUNNING | READY | a retried failure, a lost completion, a refused dispatch |
| ``hold_back`` | WAITING, READY | WAITING | a callback producer of it went back to READY |
| ``undo`` | DONE | WAITING, READY | its output was lost with an executor, or a rerun reads it |

* **WAITING** — an ordinary input does not exist yet (``deps_left > 0``), or the producer of a
  callback input (paper §5.2) has not started yet (``cb_waiting``).
* **READY** — may be dispatched; ``ready_since`` is when it became ready (Layer 2's waiting time).
* **DISPATCHED** — sent to ``executor``, which has not acknowledged it yet.
* **RUNNING** — the executor acknowledged it. A completion or failure may overtake the
  acknowledgement (they travel on different subjects), so both in-flight states can complete.
* **DONE** — completed; its outputs are in the request's tensors.

``requeue`` puts an in-flight node back to READY: its failure is retried, its completion was lost,
or its dispatch was refused. Its callback consumers that have not started go back to WAITING
(``hold_back``), so none sits on an executor waiting for a producer that has no executor.

``undo`` takes a completed node back (its outputs are to be made again; ``lineage.py`` chooses
which). It is WAITING again until its own producers are DONE and its callback producers have
started, as if it had never run; its ordinary consumers that have not run count it as a missing
input again (``deps_left``; READY ones go back to WAITING) and its callback consumers that have not
started are held back. None of its ordinary consumers may be in flight: they read the outputs
being made again, so the caller requeues them first (the check refuses the transition otherwise).
The record is marked ``rerun`` until it completes again: that run is not charged to its tenant.

:class:`NodeTable` owns the records of one attempt and the two indexes the scheduler reads on hot
paths (ready nodes in the order they became ready, and in-flight nodes); only its transitions change
a record's state, and each checks the state it starts from: a transition a node's state does not
allow raises :class:`~services.scheduler.core.errors.IllegalTransition` before anything changes.
Synchronous and I/O-free, like the rest of the core.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from libs.protocol.ids import AttemptRef, NodeRef
from libs.workflow.dag import Dag, DagNode, TensorSource
from services.scheduler.core.errors import IllegalTransition

__all__ = ["NodeRecord", "NodeState", "NodeTable"]


class NodeState(Enum):
    WAITING = "waiting"
    READY = "ready"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    DONE = "done"


WAITING, READY, DISPATCHED, RUNNING, DONE = NodeState
IN_FLIGHT = (DISPATCHED, RUNNING)


@dataclass(slots=True, eq=False)
class NodeRecord:
    """One node of one attempt: its state and everything the scheduler tracks about it."""

    ref: NodeRef
    node: DagNode  # the node's place in the DAG: ModelFn, model, inputs, outputs
    deps_left: int  # ordinary-input producers not yet done
    cb_waiting: set[str]  # callback-input producers not yet started (paper §5.2)
    critical_s: float = 0.0  # estimated critical path from this node to the request's end
    state: NodeState = WAITING
    ready_since: float = 0.0  # when it last became READY
    dispatched_at: float = 0.0  # when it was last dispatched (its time limit counts from here)
    executor: str | None = None  # where it is in flight
    charge_s: float = 0.0  # the vTime estimate its tenant was charged at dispatch
    shapes: str = ""  # shape key of its tensor inputs at dispatch (what its estimate is keyed by)
    kind: str = ""  # the kind of the executor it was dispatched to
    retries: int = 0  # failures retried so far
    pending: dict[str, TensorSource] = field(default_factory=dict)  # inputs dispatched pending
    rerun: bool = False  # undone after it completed: runs again at the platform's cost (lineage.py)
    # What the policy saw of it last, while READY: ``seen.ready_node``'s cache (None: build anew).
    view: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def in_flight(self) -> bool:
        return self.state in IN_FLIGHT


class NodeTable:
    """The nodes of one attempt at a request, and their transitions."""

    __slots__ = ("dag", "done", "in_flight", "ready", "records")

    def __init__(self, attempt: AttemptRef, dag: Dag, critical: Mapping[str, float], now: float) -> None:
        self.dag = dag
        self.records: dict[str, NodeRecord] = {
            nid: NodeRecord(
                ref=attempt.node(nid),
                node=n,
                deps_left=len(n.deps),
                cb_waiting=set(n.cb_deps),
                critical_s=critical.get(nid, 0.0),
            )
            for nid, n in dag.nodes.items()
        }
        self.ready: dict[str, NodeRecord] = {}  # in the order they became ready
        self.in_flight: dict[str, NodeRecord] = {}  # dispatched or running
        self.done = 0
        for rec in self.records.values():
            self._become_ready_if_free(rec, now)

    def __getitem__(self, node_id: str) -> NodeRecord:
        return self.records[node_id]

    def get(self, node_id: str) -> NodeRecord | None:
        return self.records.get(node_id)

    def __len__(self) -> int:
        return len(self.records)

    # -- transitions ---------------------------------------------------------------------------------
    def dispatch(
        self, node_id: str, executor: str, now: float, *, charge_s: float, shapes: str, kind: str
    ) -> NodeRecord:
        """READY → DISPATCHED. Its callback consumers may now start (paper §5.2)."""
        rec = self.records[node_id]
        _check(rec, DISPATCHED, READY)
        del self.ready[node_id]
        rec.state = DISPATCHED
        rec.executor = executor
        rec.dispatched_at = now
        rec.charge_s, rec.shapes, rec.kind = charge_s, shapes, kind
        rec.pending = {}
        self.in_flight[node_id] = rec
        for consumer in self.dag.cb_successors.get(node_id, ()):
            c = self.records[consumer]
            c.cb_waiting.discard(node_id)
            self._become_ready_if_free(c, now)
        return rec

    def accept(self, node_id: str) -> NodeRecord:
        """DISPATCHED → RUNNING: the executor acknowledged the dispatch."""
        rec = self.records[node_id]
        _check(rec, RUNNING, DISPATCHED)
        rec.state = RUNNING
        return rec

    def complete(self, node_id: str, now: float) -> NodeRecord:
        """DISPATCHED or RUNNING → DONE. Successors whose last input this was become READY."""
        rec = self.records[node_id]
        _check(rec, DONE, *IN_FLIGHT)
        # Successors already DONE read an earlier run's outputs (it ran again: ``undo``): not waiting.
        succs = [s for s in (self.records[n] for n in self.dag.successors[node_id]) if s.state is not DONE]
        for s in succs:  # all checked before anything changes
            _check(s, READY if s.deps_left == 1 else WAITING, WAITING)
        del self.in_flight[node_id]
        rec.state = DONE
        rec.executor = None
        rec.rerun = False
        self.done += 1
        for s in succs:
            s.deps_left -= 1
            self._become_ready_if_free(s, now)
        return rec

    def requeue(self, node_id: str, now: float, *, retry: bool) -> NodeRecord:
        """DISPATCHED or RUNNING → READY: run it again (``retry`` counts it as a failed try).

        Callback consumers of it that have not started are held back until it starts again.
        """
        rec = self.records[node_id]
        _check(rec, READY, *IN_FLIGHT)
        del self.in_flight[node_id]
        rec.state = READY
        rec.ready_since = now
        rec.executor = None
        rec.charge_s = 0.0
        rec.pending = {}
        if retry:
            rec.retries += 1
        self.ready[node_id] = rec
        for consumer in self.dag.cb_successors.get(node_id, ()):
            if self.records[consumer].state in (WAITING, READY):
                self.hold_back(consumer, node_id)
        return rec

    def hold_back(self, node_id: str, producer: str) -> NodeRecord:
        """WAITING or READY → WAITING: callback producer ``producer`` is not started any more."""
        rec = self.records[node_id]
        _check(rec, WAITING, WAITING, READY)
        rec.cb_waiting.add(producer)
        if rec.state is READY:
            rec.state = WAITING
            del self.ready[node_id]
        return rec

    def undo(self, node_id: str, now: float) -> NodeRecord:
        """DONE → WAITING (READY when its inputs exist): its outputs are to be made again.

        Its own ``deps_left`` and ``cb_waiting`` are counted afresh from its producers' states (some
        may be undone too, before or after it); its consumers that have not run wait for it again.
        """
        rec = self.records[node_id]
        _check(rec, WAITING, DONE)
        succs = [s for s in (self.records[n] for n in self.dag.successors[node_id]) if s.state is not DONE]
        for s in succs:  # all checked before anything changes: in-flight readers are requeued first
            _check(s, WAITING, WAITING, READY)
        rec.state = WAITING
        rec.rerun = True
        self.done -= 1
        rec.deps_left = sum(1 for p in rec.node.deps if self.records[p].state is not DONE)
        rec.cb_waiting = {p for p in rec.node.cb_deps if self.records[p].state in (WAITING, READY)}
        for s in succs:
            s.deps_left += 1
            if s.state is READY:
                s.state = WAITING
                del self.ready[s.ref.node_id]
        for consumer in self.dag.cb_successors.get(node_id, ()):
            if self.records[consumer].state in (WAITING, READY):
                self.hold_back(consumer, node_id)
        self._become_ready_if_free(rec, now)
        return rec

    def _become_ready_if_free(self, rec: NodeRecord, now: float) -> None:
        """WAITING → READY once its ordinary inputs exist and its callback producers have started."""
        if rec.state is WAITING and rec.deps_left == 0 and not rec.cb_waiting:
            rec.state = READY
            rec.ready_since = now
            self.ready[rec.ref.node_id] = rec


def _check(rec: NodeRecord, to: NodeState, *allowed: NodeState) -> None:
    if rec.state not in allowed:
        raise IllegalTransition(rec.ref, rec.state, to)
