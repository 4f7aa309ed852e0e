"""The scheduler's core: a synchronous, I/O-free state machine over requests and executors.

The asyncio shell (``service.py``) turns bus messages into calls on :class:`SchedulerCore` and
carries out the :class:`Effect` values the calls return (send a dispatch, persist progress, publish
a result). Nothing here awaits, sleeps or reads a clock: time comes in as ``now`` (monotonic
seconds), so tests drive the core with hand-built events (vLLM's ``EngineCore.step()`` shape).

Life of a request (paper §4): ``add_request`` instantiates its DAG and marks the roots ready;
``schedule`` asks the policy which ready node goes to which idle executor; ``on_complete`` records
the outputs' metadata and releases successors whose inputs are now all available; when the last
node completes the request finishes with the workflow outputs (PNG references).

Failures: a retryable node failure retries that node; losing an executor restarts every request
that had a node running there or still needs a tensor it held, as a new *attempt* (ModelFns are
deterministic, so the image is the same); a request past its deadline fails.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from libs.dataplane.meta import TensorMeta
from libs.protocol.messages import (
    ConstInput,
    Dispatch,
    ExecutorHeartbeat,
    ImageRef,
    ImageRequest,
    NodeComplete,
    NodeFailed,
    OutputPlan,
    RequestResult,
    TensorInput,
    node_key,
)
from libs.workflow.dag import Const, Dag, TensorSource
from services.scheduler.policy import Policy
from services.scheduler.snapshot import ExecutorInfo, ReadyNode, Snapshot

log = logging.getLogger(__name__)

LOAD_HALF_LIFE_S = 10.0


# -- effects: what the shell must do ------------------------------------------------------------
@dataclass(frozen=True)
class SendDispatch:
    executor: str
    msg: Dispatch


@dataclass(frozen=True)
class ReleaseAttempt:
    """Tell every executor to free the tensors of one attempt of a request."""

    request_id: str
    attempt: int


@dataclass(frozen=True)
class PersistRequest:
    """Write request state to Redis (``fields`` go into the request hash)."""

    request_id: str
    fields: dict[str, str | int | float]
    tensors: dict[str, TensorMeta] = field(default_factory=dict)  # tensor id -> meta, to add
    drop_tensors: bool = False  # the request ended: delete its tensor metadata


@dataclass(frozen=True)
class Finished:
    result: RequestResult
    tenant: str


Effect = SendDispatch | ReleaseAttempt | PersistRequest | Finished


class NodeStatus(Enum):
    WAITING = "waiting"
    READY = "ready"
    RUNNING = "running"
    DONE = "done"


@dataclass
class ExecutorState:
    id: str
    kind: str
    fns: frozenset[str]
    last_seen: float
    resident: frozenset[str] = frozenset()
    arena_free: int = 0
    running: str | None = None  # node key we dispatched and have not seen finish
    acked_seq: int | None = None  # executor's heartbeat seq when it accepted ``running``
    foreign: tuple[str, ...] = ()  # nodes it reports running that this scheduler never dispatched
    suspect: bool = False  # a dispatch to it went unanswered: skip it until it heartbeats again
    load: float = 0.0
    load_at: float = 0.0

    @property
    def idle(self) -> bool:
        return self.running is None and not self.foreign and not self.suspect


@dataclass
class RequestRun:
    """One attempt at one request."""

    req: ImageRequest
    dag: Dag
    attempt: int
    arrived: float
    deadline: float
    status: dict[str, NodeStatus]
    remaining: dict[str, int]  # node -> dependencies not yet done
    ready: dict[str, float] = field(default_factory=dict)  # node -> since (insertion ordered)
    running: dict[str, str] = field(default_factory=dict)  # node -> executor
    tensors: dict[TensorSource, TensorMeta] = field(default_factory=dict)
    reads_left: dict[TensorSource, int] = field(default_factory=dict)
    sinks: dict[str, ImageRef] = field(default_factory=dict)
    done: int = 0
    executors: set[str] = field(default_factory=set)
    bytes_moved: int = 0
    gpu_s: float = 0.0
    retries: dict[str, int] = field(default_factory=dict)
    restarts: int = 0

    @property
    def request_id(self) -> str:
        return self.req.request_id


class SchedulerCore:
    def __init__(
        self,
        policy: Policy,
        *,
        heartbeat_timeout_s: float = 5.0,
        max_node_retries: int = 2,
        max_restarts: int = 2,
    ) -> None:
        self.policy = policy
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_node_retries = max_node_retries
        self.max_restarts = max_restarts
        self.executors: dict[str, ExecutorState] = {}
        self.runs: dict[str, RequestRun] = {}  # request id -> current attempt
        self._known_keys: OrderedDict[str, None] = OrderedDict()  # node keys we dispatched (bounded)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, req: ImageRequest, dag: Dag, *, attempt: int, now: float) -> list[Effect]:
        if req.request_id in self.runs:
            return []  # a redelivery of a request in progress: keep going
        run = self._new_run(req, dag, attempt, arrived=now, deadline=now + req.timeout_s)
        self.runs[req.request_id] = run
        return [self._persist(run, status="queued")]

    def _new_run(
        self, req: ImageRequest, dag: Dag, attempt: int, arrived: float, deadline: float
    ) -> RequestRun:
        run = RequestRun(
            req=req,
            dag=dag,
            attempt=attempt,
            arrived=arrived,
            deadline=deadline,
            status={n: NodeStatus.WAITING for n in dag.nodes},
            remaining={n.id: len(n.deps) for n in dag.nodes.values()},
            reads_left=dict(dag.consumers),
        )
        for n in dag.nodes.values():
            if not n.deps:
                run.status[n.id] = NodeStatus.READY
                run.ready[n.id] = arrived
        return run

    @property
    def active(self) -> int:
        return len(self.runs)

    # -- executors -------------------------------------------------------------------------------
    def on_heartbeat(self, hb: ExecutorHeartbeat, now: float) -> list[Effect]:
        ex = self.executors.get(hb.executor)
        if ex is None:
            ex = ExecutorState(
                id=hb.executor, kind=hb.kind, fns=frozenset(hb.fns), last_seen=now, load_at=now
            )
            self.executors[hb.executor] = ex
            log.info("executor %s joined (%s, %d ModelFns)", hb.executor, hb.kind, len(hb.fns))
        ex.last_seen = now
        ex.fns = frozenset(hb.fns)
        ex.resident = frozenset(hb.resident)
        ex.arena_free = hb.arena_free
        ex.suspect = False
        ex.foreign = tuple(k for k in hb.running if k not in self._known_keys)
        effects: list[Effect] = []
        if ex.running and ex.acked_seq is not None and hb.seq > ex.acked_seq and ex.running not in hb.running:
            # It accepted the node, later reported itself not running it, and no completion came:
            # the completion was lost (core NATS is at-most-once). Run the node again.
            log.warning("completion of %s on %s was lost; retrying the node", ex.running, ex.id)
            effects += self._requeue(ex.running, ex.id, now, reason="completion lost")
            ex.running = None
        return effects

    def remove_executor(self, executor_id: str, now: float, reason: str) -> list[Effect]:
        ex = self.executors.pop(executor_id, None)
        if ex is None:
            return []
        log.warning("executor %s removed: %s", executor_id, reason)
        effects: list[Effect] = []
        for run in list(self.runs.values()):
            if executor_id in run.running.values() or any(
                meta.executor == executor_id and run.reads_left.get(src, 0) > 0
                for src, meta in run.tensors.items()
            ):
                effects += self._restart(run, now, f"executor {executor_id} lost ({reason})")
        return effects

    def dispatch_result(
        self, key: str, executor_id: str, *, ok: bool, seq: int, error: str, now: float
    ) -> list[Effect]:
        """The executor answered a dispatch (``ok``) or did not (``error`` says why)."""
        ex = self.executors.get(executor_id)
        if ex is None or ex.running != key:
            return []
        if ok:
            ex.acked_seq = seq
            return []
        log.warning("dispatch of %s to %s failed: %s", key, executor_id, error)
        ex.running = None
        ex.suspect = True
        return self._requeue(key, executor_id, now, reason=error, count_retry=False)

    def expire(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for ex in list(self.executors.values()):
            if now - ex.last_seen > self.heartbeat_timeout_s:
                effects += self.remove_executor(ex.id, now, f"no heartbeat for {now - ex.last_seen:.1f}s")
        for run in list(self.runs.values()):
            if now > run.deadline:
                effects += self._fail(run, f"timed out after {run.req.timeout_s:.0f}s", code="timeout")
        return effects

    # -- scheduling ---------------------------------------------------------------------------------
    def snapshot(self, now: float) -> Snapshot:
        ready = []
        for run in self.runs.values():
            for node_id, since in run.ready.items():
                node = run.dag.nodes[node_id]
                inputs = tuple(
                    (run.tensors[s].executor, run.tensors[s].nbytes)
                    for s in node.inputs.values()
                    if isinstance(s, TensorSource) and s in run.tensors
                )
                ready.append(
                    ReadyNode(
                        key=node_key(run.request_id, run.attempt, node_id),
                        request_id=run.request_id,
                        node_id=node_id,
                        tenant=run.req.tenant,
                        fn=node.fn,
                        model=node.model,
                        order=node.order,
                        submitted_at=run.arrived,
                        ready_since=since,
                        inputs=inputs,
                    )
                )
        idle = tuple(
            ExecutorInfo(
                id=e.id, fns=e.fns, resident=e.resident, load=self._load(e, now), arena_free=e.arena_free
            )
            for e in self.executors.values()
            if e.idle
        )
        return Snapshot(now=now, ready=tuple(ready), idle=idle)

    def schedule(self, now: float) -> list[Effect]:
        snap = self.snapshot(now)
        if not snap.ready or not snap.idle:
            return []
        effects: list[Effect] = []
        for a in self.policy(snap):
            request_id, attempt, node_id = _split_key(a.node_key)
            run = self.runs.get(request_id)
            ex = self.executors.get(a.executor)
            if run is None or run.attempt != attempt or node_id not in run.ready or ex is None or not ex.idle:
                log.error("policy returned an invalid assignment %s -> %s; ignored", a.node_key, a.executor)
                continue
            effects += self._dispatch(run, node_id, ex, now)
        return effects

    def _dispatch(self, run: RequestRun, node_id: str, ex: ExecutorState, now: float) -> list[Effect]:
        node = run.dag.nodes[node_id]
        del run.ready[node_id]
        run.status[node_id] = NodeStatus.RUNNING
        run.running[node_id] = ex.id
        key = node_key(run.request_id, run.attempt, node_id)
        ex.running, ex.acked_seq = key, None
        ex.load = self._load(ex, now) + 1.0
        ex.load_at = now
        self._known_keys[key] = None
        while len(self._known_keys) > 100_000:
            self._known_keys.popitem(last=False)
        inputs: dict[str, TensorInput | ConstInput] = {}
        for name, src in node.inputs.items():
            inputs[name] = ConstInput(src.value) if isinstance(src, Const) else TensorInput(run.tensors[src])
        sinks = {src: name for name, src in run.dag.outputs.items()}
        outputs = [
            OutputPlan(
                name=out,
                consumers=run.dag.consumers.get(TensorSource(node_id, out), 0),
                sink=f"{run.request_id}/{sinks[TensorSource(node_id, out)]}.png"
                if TensorSource(node_id, out) in sinks
                else "",
            )
            for out in node.outputs
        ]
        msg = Dispatch(
            request_id=run.request_id,
            attempt=run.attempt,
            node_id=node_id,
            tenant=run.req.tenant,
            fn=node.fn,
            model=node.model,
            inputs=inputs,
            outputs=outputs,
            callbacks=sorted(node.callbacks),
        )
        effects: list[Effect] = [SendDispatch(ex.id, msg)]
        if run.done == 0 and len(run.running) == 1:
            effects.append(self._persist(run, status="running"))
        return effects

    # -- completions -------------------------------------------------------------------------------
    def on_complete(self, msg: NodeComplete, now: float) -> list[Effect]:
        ex = self.executors.get(msg.executor)
        if ex is not None and ex.running == msg.key:
            ex.running = None
        run = self.runs.get(msg.request_id)
        if run is None or run.attempt != msg.attempt or run.running.get(msg.node_id) != msg.executor:
            # A completion of an attempt that was restarted or already failed: free its outputs.
            return [ReleaseAttempt(msg.request_id, msg.attempt)] if msg.outputs else []
        node = run.dag.nodes[msg.node_id]
        missing = [
            o
            for o in node.outputs
            if run.dag.consumers.get(TensorSource(node.id, o), 0) and o not in msg.outputs
        ]
        sinks = {src.output: name for name, src in run.dag.outputs.items() if src.node == node.id}
        missing += [o for o in sinks if o not in msg.sinks]
        if missing:
            return self._fail(run, f"node {node.id} ({node.fn}) returned no {missing}", code="workflow")
        del run.running[msg.node_id]
        run.status[msg.node_id] = NodeStatus.DONE
        run.done += 1
        run.executors.add(msg.executor)
        run.bytes_moved += msg.bytes_in
        run.gpu_s += msg.timing.total_s
        new_tensors: dict[str, TensorMeta] = {}
        for out, meta in msg.outputs.items():
            src = TensorSource(node.id, out)
            if src in run.dag.consumers:
                run.tensors[src] = meta
                new_tensors[meta.tensor_id] = meta
        for inp in node.inputs.values():
            if isinstance(inp, TensorSource):
                run.reads_left[inp] = run.reads_left.get(inp, 1) - 1
        for out, ref in msg.sinks.items():
            run.sinks[sinks[out]] = ref
        for succ in run.dag.successors[node.id]:
            run.remaining[succ] -= 1
            if run.remaining[succ] == 0:
                run.status[succ] = NodeStatus.READY
                run.ready[succ] = now
        if run.done == len(run.dag.nodes):
            return self._succeed(run)
        return [self._persist(run, status="running", tensors=new_tensors)]

    def on_failed(self, msg: NodeFailed, now: float) -> list[Effect]:
        ex = self.executors.get(msg.executor)
        if ex is not None and ex.running == msg.key:
            ex.running = None
        run = self.runs.get(msg.request_id)
        if run is None or run.attempt != msg.attempt or run.running.get(msg.node_id) != msg.executor:
            return []
        if msg.unreachable and msg.unreachable != msg.executor and msg.unreachable in self.executors:
            # The node could not read a producer's tensor: treat the producer as lost now rather
            # than retrying until its heartbeat times out. That restarts this request (and every
            # other that needs its tensors); a producer that is in fact alive rejoins on its next beat.
            run.running.pop(msg.node_id, None)
            effects = self.remove_executor(
                msg.unreachable, now, f"unreachable from {msg.executor}: {msg.error}"
            )
            if self.runs.get(msg.request_id) is not run:
                return effects
            run.running[msg.node_id] = msg.executor
        if msg.retryable and run.retries.get(msg.node_id, 0) < self.max_node_retries:
            return self._requeue(msg.key, msg.executor, now, reason=msg.error)
        node = run.dag.nodes[msg.node_id]
        return self._fail(
            run, f"node {msg.node_id} ({node.fn}) failed on {msg.executor}: {msg.error}", code="workflow"
        )

    # -- internals -----------------------------------------------------------------------------------
    def _requeue(
        self, key: str, executor_id: str, now: float, reason: str, count_retry: bool = True
    ) -> list[Effect]:
        request_id, attempt, node_id = _split_key(key)
        run = self.runs.get(request_id)
        if run is None or run.attempt != attempt or run.running.get(node_id) != executor_id:
            return []
        del run.running[node_id]
        if count_retry:
            run.retries[node_id] = run.retries.get(node_id, 0) + 1
            if run.retries[node_id] > self.max_node_retries:
                return self._fail(
                    run,
                    f"node {node_id} failed {run.retries[node_id]} times, last: {reason}",
                    code="workflow",
                )
        run.status[node_id] = NodeStatus.READY
        run.ready[node_id] = now
        return []

    def _restart(self, run: RequestRun, now: float, reason: str) -> list[Effect]:
        if run.restarts >= self.max_restarts:
            return self._fail(run, f"{reason}; gave up after {run.restarts} restarts", code="internal")
        log.warning("restarting request %s (attempt %d): %s", run.request_id, run.attempt + 1, reason)
        fresh = self._new_run(run.req, run.dag, run.attempt + 1, arrived=run.arrived, deadline=run.deadline)
        fresh.restarts = run.restarts + 1
        self.runs[run.request_id] = fresh
        return [
            ReleaseAttempt(run.request_id, run.attempt),
            self._persist(fresh, status="queued", restarted=reason),
        ]

    def _succeed(self, run: RequestRun) -> list[Effect]:
        return self._end(run, "succeeded")

    def _fail(self, run: RequestRun, error: str, code: str) -> list[Effect]:
        log.warning("request %s failed: %s", run.request_id, error)
        return self._end(run, "failed", error, code)

    def _end(self, run: RequestRun, status: str, error: str = "", code: str = "") -> list[Effect]:
        # Executors still computing nodes of a failed run keep ``running`` set; their completions
        # arrive stale, free the executor and release the attempt's tensors again.
        self.runs.pop(run.request_id, None)
        result = RequestResult(
            request_id=run.request_id,
            status=status,  # type: ignore[arg-type]
            images=dict(run.sinks) if status == "succeeded" else {},
            error=error,
            error_code=code,
            nodes=len(run.dag.nodes),
            executors=sorted(run.executors),
            bytes_moved=run.bytes_moved,
            gpu_s=run.gpu_s,
        )
        return [
            ReleaseAttempt(run.request_id, run.attempt),
            self._persist(run, status=status, drop_tensors=True, error=error),
            Finished(result, run.req.tenant),
        ]

    def _persist(
        self,
        run: RequestRun,
        status: str,
        tensors: dict[str, TensorMeta] | None = None,
        drop_tensors: bool = False,
        **extra: str,
    ) -> PersistRequest:
        fields: dict[str, str | int | float] = {
            "status": status,
            "tenant": run.req.tenant,
            "workflow": run.req.workflow,
            "attempt": run.attempt,
            "nodes_total": len(run.dag.nodes),
            "nodes_done": run.done,
            "bytes_moved": run.bytes_moved,
            "gpu_s": round(run.gpu_s, 6),
            "executors": ",".join(sorted(run.executors)),
            **{k: v for k, v in extra.items() if v},
        }
        return PersistRequest(run.request_id, fields, tensors or {}, drop_tensors)

    def _load(self, ex: ExecutorState, now: float) -> float:
        return ex.load * 0.5 ** ((now - ex.load_at) / LOAD_HALF_LIFE_S)

    def stats(self) -> dict[str, int]:
        return {
            "requests": len(self.runs),
            "executors": len(self.executors),
            "idle_executors": sum(1 for e in self.executors.values() if e.idle),
            "ready_nodes": sum(len(r.ready) for r in self.runs.values()),
            "running_nodes": sum(len(r.running) for r in self.runs.values()),
        }


def _split_key(key: str) -> tuple[str, int, str]:
    request_id, attempt, node_id = key.split("/", 2)
    return request_id, int(attempt), node_id
