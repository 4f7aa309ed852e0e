"""The scheduler's core: a synchronous, I/O-free state machine over requests and executors.

The asyncio shell (``service.py``) turns bus messages into calls on :class:`SchedulerCore` and
carries out the :class:`Effect` values the calls return (send a dispatch, persist progress, publish
a result). Nothing here awaits, sleeps or reads a clock: time comes in as ``now`` (monotonic
seconds), so tests drive the core with hand-built events (vLLM's ``EngineCore.step()`` shape).

Life of a request (paper §4): ``add_request`` instantiates its DAG, one
:class:`~services.scheduler.core.lifecycle.NodeRecord` per node, with the roots ready; ``schedule`` asks
the policy which ready node goes to which idle executor; ``on_complete`` records the outputs'
metadata and releases successors whose inputs are now all available; when the last node completes
the request finishes with the workflow outputs (PNG references). Every change of a node's state is
a transition of its attempt's :class:`~services.scheduler.core.lifecycle.NodeTable`, which refuses one
that does not start from the node's state (:class:`~services.scheduler.core.errors.IllegalTransition`);
events that arrive stale (a completion of a restarted attempt, an answer to a dispatch that was
already requeued) are recognised here and dropped before any transition.

Failures: a retryable node failure retries that node; losing an executor re-runs, in the same
attempt, the nodes that were running there and the lineage of the tensors it held that are still
needed (``lineage.py``; ModelFns are deterministic, so the image is the same), restarting the
request as a new *attempt* only where that cannot apply; a request past its deadline (``submitted_at`` +
``timeout_s``, ``deadlines.py``) fails, and none of its nodes is dispatched after it; a node that
runs past its time limit, or completes with a timing that is not finite and >= 0, runs again
elsewhere (``guards.py``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from libs.protocol.ids import AttemptRef, NodeRef, image_object
from libs.protocol.messages import (
    CallbackReady,
    CancelNode,
    Dispatch,
    ExecutorHeartbeat,
    ImageRequest,
    InputBinding,
    NodeComplete,
    NodeFailed,
    OutputPlan,
    RequestResult,
)
from libs.protocol.tensor_meta import TensorMeta
from libs.workflow.dag import Dag, TensorSource
from services.scheduler.core import lineage, progress, seen, views
from services.scheduler.core.accounting import Accounts
from services.scheduler.core.deployment import Deployment
from services.scheduler.core.effects import (
    Effect,
    Finished,
    PersistRequest,
    ReleaseAttempt,
    SendCallback,
    SendCancel,
    SendDispatch,
)
from services.scheduler.core.estimates import Estimator
from services.scheduler.core.executors import ExecutorState
from services.scheduler.core.guards import overdue, timing_problem
from services.scheduler.core.lifecycle import NodeRecord, NodeState, NodeTable
from services.scheduler.core.policy import Policy
from services.scheduler.core.records import RequestRun, binding, metas_of, persist
from services.scheduler.core.snapshot import Snapshot

log = logging.getLogger(__name__)


class SchedulerCore:
    def __init__(
        self,
        policy: Policy,
        *,
        heartbeat_timeout_s: float = 5.0,
        max_node_retries: int = 2,
        max_restarts: int = 2,
        estimator: Estimator | None = None,
        accounts: Accounts | None = None,
        node_time_limit_s: float = 600.0,
        node_time_factor: float = 10.0,
        deployment: Deployment | None = None,
    ) -> None:
        self.policy = policy
        self.deployment = deployment or Deployment()  # ours, or a baseline's placement (deployment.py)
        self.estimator = estimator or Estimator()
        self.accounts = accounts or Accounts()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_node_retries = max_node_retries
        self.max_restarts = max_restarts
        self.node_time_limit_s = node_time_limit_s  # a node may run max(this, factor × estimate)
        self.node_time_factor = node_time_factor
        self.executors: dict[str, ExecutorState] = {}
        self.runs: dict[str, RequestRun] = {}  # request id -> current attempt
        self._dispatched: OrderedDict[NodeRef, None] = OrderedDict()  # nodes we dispatched (bounded)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(
        self, req: ImageRequest, dag: Dag, *, attempt: int, now: float, deadline: float | None = None
    ) -> list[Effect]:
        """Take a request in; ``deadline`` (monotonic) defaults to ``now + timeout_s`` (the shell
        passes ``submitted_at + timeout_s``: ``deadlines.py``). One already past it fails in the next
        ``schedule`` without any node dispatched."""
        if req.request_id in self.runs:
            return []  # a redelivery of a request in progress: keep going
        due = now + req.timeout_s if deadline is None else deadline
        run = self._new_run(req, dag, attempt, arrived=now, deadline=due)
        self.runs[req.request_id] = run
        self.accounts.request_started(req.tenant)
        return [self._persist(run, status="queued")]

    def _new_run(
        self, req: ImageRequest, dag: Dag, attempt: int, arrived: float, deadline: float
    ) -> RequestRun:
        # Remaining critical-path time per node (Layer 2's r), from the current estimates.
        est = {n.id: self.estimator.estimate(n.fn, n.model) for n in dag.nodes.values()}
        critical: dict[str, float] = {}
        for node_id in reversed(dag.nodes):
            tail = max((critical[s] for s in dag.successors[node_id]), default=0.0)
            critical[node_id] = est[node_id] + tail
        ref = AttemptRef(req.request_id, attempt)
        step_of, step_sizes = progress.step_units(dag)
        return RequestRun(
            req=req,
            dag=dag,
            ref=ref,
            arrived=arrived,
            deadline=deadline,
            nodes=NodeTable(ref, dag, critical, arrived),
            reads_left=dict(dag.consumers),
            job_s=sum(est.values()),
            step_of=step_of,
            step_sizes=step_sizes,
            step_left=dict(step_sizes),
        )

    def _in_flight(self, node: NodeRef, executor_id: str) -> tuple[RequestRun, NodeRecord] | None:
        """The current attempt's record of ``node`` if it is in flight on ``executor_id``; None when
        an event about it is stale (its attempt restarted or ended, or it was requeued meanwhile)."""
        run = self.runs.get(node.request_id)
        if run is None or run.attempt != node.attempt:
            return None
        rec = run.nodes.get(node.node_id)
        if rec is None or not rec.in_flight or rec.executor != executor_id:
            return None
        return run, rec

    def _ended_on(self, node: NodeRef, executor_id: str) -> tuple[RequestRun, NodeRecord] | None:
        """A node ended on an executor (completed or failed): the executor is free of it; then as
        :meth:`_in_flight`."""
        ex = self.executors.get(executor_id)
        if ex is not None and ex.running == node:
            ex.running = None
        if ex is not None and ex.hung == node:
            ex.hung = None  # the node that overran its limit there ended after all
        return self._in_flight(node, executor_id)

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
        running = ex.apply_report(hb, now)
        self.deployment.heard(hb)
        ex.foreign = tuple(r for r in running if r not in self._dispatched)
        effects: list[Effect] = []
        if ex.running and ex.acked_seq is not None and hb.seq > ex.acked_seq and ex.running not in running:
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
            effects += self._recover(run, executor_id, now, f"executor {executor_id} lost ({reason})")
        return effects

    def dispatch_result(
        self, node: NodeRef, executor_id: str, *, ok: bool, seq: int, error: str, now: float
    ) -> list[Effect]:
        """The executor answered a dispatch (``ok``) or did not (``error`` says why)."""
        ex = self.executors.get(executor_id)
        if ex is None or ex.running != node:
            return []
        found = self._in_flight(node, executor_id)
        if ok:
            ex.acked_seq = seq
            # A completion may have overtaken the answer, and a retry sent to the same executor may
            # find the answer to its first dispatch: only a node still DISPATCHED moves on.
            if found is not None and found[1].state is NodeState.DISPATCHED:
                found[0].nodes.accept(node.node_id)
            return []
        log.warning("dispatch of %s to %s failed: %s", node, executor_id, error)
        ex.running = None
        ex.suspect = True
        if found is None:
            return []
        run, rec = found
        refund = [] if rec.rerun else [self.accounts.refund(run.req.tenant, rec.charge_s)]
        return [*refund, *self._requeue(node, executor_id, now, reason=error, retry=False)]

    def expire(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for ex in list(self.executors.values()):
            if now - ex.last_seen > self.heartbeat_timeout_s:
                effects += self.remove_executor(ex.id, now, f"no heartbeat for {now - ex.last_seen:.1f}s")
        for late in overdue(list(self.runs.values()), now, self.node_time_limit_s, self.node_time_factor):
            ref, ex_id = late.rec.ref, late.rec.executor or ""
            if self.runs.get(ref.request_id) is not late.run or not late.rec.in_flight:
                continue  # an earlier one of these restarted or ended its request
            log.warning("node %s ran %.1fs on %s, past its %.0fs limit", ref, late.ran_s, ex_id, late.limit_s)
            ex = self.executors.get(ex_id)
            if ex is not None and ex.running == ref:
                ex.running, ex.hung = None, ref  # no work there until it stops reporting the node
            if ex is not None:
                # Stop it there: a simulated runner stops at once, a real one (its thread cannot be
                # stopped) answers and exits for its supervisor to restart it (``restart_ok``).
                effects.append(
                    SendCancel(ex_id, CancelNode(ref.request_id, ref.attempt, ref.node_id, restart_ok=True))
                )
            if late.rec.retries >= self.max_node_retries:
                why = f"node {ref.node_id} ran past its {late.limit_s:.0f}s time limit {late.rec.retries + 1} times"
                effects += self._fail(late.run, why, code="timeout")
            else:
                effects += self._requeue(
                    ref, ex_id, now, reason=f"ran past its {late.limit_s:.0f}s time limit"
                )
        return effects + self._fail_expired(now)

    def _fail_expired(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for run in [r for r in self.runs.values() if now >= r.deadline]:
            done = f"{run.nodes.done} of {len(run.nodes)} nodes done"
            why = f"deadline passed ({run.req.timeout_s:g}s after submission; {done})"
            effects += self._fail(run, why, code="timeout")
        return effects

    # -- scheduling ---------------------------------------------------------------------------------
    def snapshot(self, now: float) -> Snapshot:
        idle_execs = [e for e in self.executors.values() if e.idle]
        # Estimates per kind when unambiguous: the idle executors' (where nodes may go), or with
        # none idle (a round for vTime lifts only, no estimate used) every executor's, so that the
        # ready nodes' values are not all rebuilt for it and again for the next round.
        kinds = {e.kind for e in idle_execs or self.executors.values()}
        kind = next(iter(kinds)) if len(kinds) == 1 else None
        memo: dict = {}  # estimates per (ModelFn, model, shapes), looked up once per snapshot
        ready = tuple(
            seen.ready_node(run, rec, self.estimator, kind, now, memo)
            for run in self.runs.values()
            for rec in run.nodes.ready.values()
        )
        idle = tuple(seen.executor_info(e, now) for e in idle_execs)
        return Snapshot(now=now, ready=ready, idle=idle, tenants=self.accounts.views())

    def schedule(self, now: float) -> list[Effect]:
        """Run the policy: lifts for tenants that (re)joined, then dispatches to idle executors.

        With no idle executor the policy still runs when a tenant with ready work is new, returning
        or rejoining, so its lift takes effect the moment it becomes eligible (the bound of paper §6
        is stated from that point on), not when an executor next frees up. Requests past their
        deadline fail first: no node of theirs is dispatched.
        """
        return self._fail_expired(now) + self._schedule(now)

    def _schedule(self, now: float) -> list[Effect]:
        if not any(run.nodes.ready for run in self.runs.values()):
            self._note_waiting()  # nothing to place: no snapshot (it is the costly part)
            return []
        has_idle = any(e.idle for e in self.executors.values())
        if not has_idle:
            with_ready = {run.req.tenant for run in self.runs.values() if run.nodes.ready}
            due = any(self.accounts[t].returning or not self.accounts[t].waiting for t in with_ready)
            if not due:
                self._note_waiting()
                return []
        snap = self.snapshot(now)
        if not snap.ready:
            self._note_waiting()
            return []
        decision = self.deployment.decide(self.policy, snap, self.runs, self.executors)
        effects: list[Effect] = []
        for tenant, vtime in decision.lifts.items():
            before = self.accounts[tenant].vtime
            if (lifted := self.accounts.lift(tenant, vtime)) is not None:
                log.debug("vTime lift: tenant %s joins at %.3fs (was %.3fs)", tenant, vtime, before)
                effects.append(lifted)
        for tenant, op_floor in decision.op_lifts.items():
            if (lifted := self.accounts.lift_ops(tenant, op_floor)) is not None:
                effects.append(lifted)
        for tenant in {n.tenant for n in snap.ready}:
            self.accounts.settle(tenant)
        if not snap.idle:
            self._note_waiting()
            return effects
        for a in decision.assignments:
            run = self.runs.get(a.node.request_id)
            ex = self.executors.get(a.executor)
            if (
                run is None
                or run.attempt != a.node.attempt
                or a.node.node_id not in run.nodes.ready
                or ex is None
                or not ex.idle
            ):
                log.error("policy returned an invalid assignment %s -> %s; ignored", a.node, a.executor)
                continue
            effects += self._dispatch(run, a.node.node_id, ex, now, a.charge_s)
        self._note_waiting()
        return effects

    def _note_waiting(self) -> None:
        """Record which tenants are left with ready work waiting (eligible-backlogged, paper §6)."""
        waiting = {run.req.tenant for run in self.runs.values() if run.nodes.ready}
        for name, acct in self.accounts.tenants.items():
            acct.waiting = name in waiting

    def _dispatch(
        self, run: RequestRun, node_id: str, ex: ExecutorState, now: float, charge_s: float
    ) -> list[Effect]:
        # Its callback consumers may start from now on (paper §5.2): they become ready here.
        rec = run.nodes.dispatch(
            node_id, ex.id, now, charge_s=charge_s, shapes=seen.input_shapes(run, node_id), kind=ex.kind
        )
        node = rec.node
        ex.note_dispatch(rec.ref, now)
        self.deployment.dispatched(run.request_id, ex.id)
        self._dispatched[rec.ref] = None
        while len(self._dispatched) > 100_000:
            self._dispatched.popitem(last=False)
        inputs: dict[str, InputBinding] = {}
        for name, src in node.inputs.items():
            inputs[name] = binding(run, rec, name, src)
        sinks = {src: name for name, src in run.dag.outputs.items()}
        outputs = [
            OutputPlan(  # the reads still planned (all of them unless it runs again: lineage.py)
                name=out,
                consumers=run.reads_left.get(TensorSource(node_id, out), 0),
                sink=image_object(run.request_id, sinks[TensorSource(node_id, out)])
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
            workflow=run.req.workflow,
            deployment=self.deployment.mode,
        )
        effects: list[Effect] = [SendDispatch(ex.id, msg)]
        if not rec.rerun:  # a rerun after a loss is the platform's: charged nothing (docs/scheduling.md)
            effects.append(self.accounts.charge(run.req.tenant, charge_s))
        if run.nodes.done == 0 and len(run.nodes.in_flight) == 1:
            effects.append(self._persist(run, status="running"))
        return effects

    # -- completions -------------------------------------------------------------------------------
    def on_complete(self, msg: NodeComplete, now: float) -> list[Effect]:
        ref = msg.ref
        if (problem := timing_problem(msg.timing)) is not None:
            return self.reject_completion(ref, msg.executor, now, problem)
        found = self._ended_on(ref, msg.executor)
        if found is None:
            run = self.runs.get(ref.request_id)
            if run is not None and run.attempt == ref.attempt:
                # A late or duplicate completion in the live attempt (e.g. of a node requeued after
                # it overran): its outputs share ids with the rerun's, so they are left to the
                # attempt's release when the request ends rather than released by id now.
                return []
            # A completion of an attempt that was restarted or already failed: free its outputs.
            return [ReleaseAttempt(ref.attempt_ref)] if msg.outputs else []
        run, rec = found
        node = rec.node
        missing = [
            o
            for o in node.outputs
            if run.reads_left.get(TensorSource(node.id, o), 0) and o not in msg.outputs
        ]
        sinks = {src.output: name for name, src in run.dag.outputs.items() if src.node == node.id}
        missing += [o for o in sinks if o not in msg.sinks]
        if missing:
            return self._fail(run, f"node {node.id} ({node.fn}) returned no {missing}", code="workflow")
        free = rec.rerun  # completing clears it
        run.nodes.complete(node.id, now)  # successors whose last input this was are ready now
        progress.node_done(run, node.id)
        t = msg.timing
        self.estimator.observe(
            node.fn,
            node.model,
            rec.shapes,
            rec.kind,
            run_s=t.fetch_s + t.exec_s + t.store_s,
            load_s=t.load_s,
            load_tier=t.load_tier or "disk",
            load_frac=t.load_frac,
        )
        run.rerun_s += t.total_s if free else 0.0  # a rerun is the platform's: charged nothing, now too
        correction = [] if free else [self.accounts.correct(run.req.tenant, rec.charge_s, t.total_s)]
        run.executors.add(msg.executor)
        run.bytes_moved += msg.bytes_in
        run.gpu_s += msg.timing.total_s
        event = progress.node_event(run, msg, node.fn, node.model)  # the client's progress stream
        new_tensors: dict[str, TensorMeta] = {}
        forwards: list[Effect] = []
        for out, meta in msg.outputs.items():
            src = TensorSource(node.id, out)
            if src in run.dag.consumers:
                run.tensors[src] = meta
                run.tensors_version += 1
                new_tensors.update((m.tensor_id, m) for m in metas_of(meta))
        for consumer in run.dag.cb_successors.get(node.id, ()):  # running consumers wait for these
            c = run.nodes[consumer]
            if not c.in_flight:  # it gets the tensor itself when it is dispatched
                continue
            for name, src in list(c.pending.items()):
                if src.node == node.id and src in run.tensors:
                    ready = CallbackReady(run.request_id, run.attempt, consumer, name, run.tensors[src])
                    forwards.append(SendCallback(c.executor, ready))
                    run.callbacks_forwarded += 1
                    del c.pending[name]
        for inp in node.inputs.values():
            if isinstance(inp, TensorSource):
                run.reads_left[inp] = run.reads_left.get(inp, 1) - 1
        for out, image in msg.sinks.items():
            run.sinks[sinks[out]] = image
        if run.nodes.done == len(run.nodes):
            return [*correction, *forwards, event, *self._succeed(run)]
        return [*correction, *forwards, event, self._persist(run, status="running", tensors=new_tensors)]

    def reject_completion(self, node: NodeRef, executor_id: str, now: float, problem: str) -> list[Effect]:
        """A completion that cannot be believed (its timing is not finite and >= 0): dropped, and
        the node is treated as lost (run again; its tenant keeps the estimate charged)."""
        log.error("dropped the completion of %s from %s: %s; the node runs again", node, executor_id, problem)
        if self._ended_on(node, executor_id) is None:
            return []
        return self._requeue(node, executor_id, now, reason=f"bad completion ({problem})")

    def on_failed(self, msg: NodeFailed, now: float) -> list[Effect]:
        ref = msg.ref
        found = self._ended_on(ref, msg.executor)
        if found is None:
            return []
        run, rec = found
        effects: list[Effect] = []
        if msg.unreachable and msg.unreachable != msg.executor and msg.unreachable in self.executors:
            # The node could not read a producer's tensor: treat the producer as lost now rather
            # than retrying until its heartbeat times out. That re-runs what this request (and every
            # other) needs of its tensors, this node included; a producer that is in fact alive
            # rejoins on its next beat.
            effects = self.remove_executor(
                msg.unreachable, now, f"unreachable from {msg.executor}: {msg.error}"
            )
            if self._in_flight(ref, msg.executor) is None:
                return effects  # put back by the recovery, or its attempt restarted or failed: moot
        if msg.retryable and rec.retries < self.max_node_retries:
            return effects + self._requeue(ref, msg.executor, now, reason=msg.error)
        return effects + self._fail(
            run, f"node {msg.node_id} ({rec.node.fn}) failed on {msg.executor}: {msg.error}", code="workflow"
        )

    # -- internals -----------------------------------------------------------------------------------
    def _requeue(
        self, node: NodeRef, executor_id: str, now: float, reason: str, retry: bool = True
    ) -> list[Effect]:
        """Put an in-flight node back to ready (``retry``: a failed try, given up after too many)."""
        found = self._in_flight(node, executor_id)
        if found is None:
            return []
        run, rec = found
        if retry and rec.retries >= self.max_node_retries:
            return self._fail(
                run, f"node {node.node_id} failed {rec.retries + 1} times, last: {reason}", code="workflow"
            )
        # Its callback consumers that have not started wait for it again (see lifecycle.py).
        run.nodes.requeue(node.node_id, now, retry=retry)
        return []

    def _recover(self, run: RequestRun, executor_id: str, now: float, reason: str) -> list[Effect]:
        """Re-run, in the same attempt, what ``run`` lost with ``executor_id`` (``lineage.py``). Nodes
        put back are cancelled where still running and refunded (the platform lost their run)."""
        recovery = lineage.plan(run, executor_id)
        if recovery is None:
            return []
        if (why := lineage.unrepresentable(run, recovery)) is not None:
            # Only a state the lineage plan does not foresee (a bug): start over as before.
            return self._restart(run, now, f"{reason}; no lineage re-execution: {why}")
        log.warning("request %s re-runs %s: %s", run.request_id, ", ".join(recovery.moved), reason)
        reset = [run.nodes[nid] for nid in recovery.reset]
        effects = self._cancel_running(reset)
        effects += [self.accounts.refund(run.req.tenant, r.charge_s) for r in reset if not r.rerun]
        lineage.apply(run, recovery, now)
        progress.recount(run)  # steps whose nodes were undone are not done any more
        kept = {m.tensor_id: m for meta in run.tensors.values() for m in metas_of(meta)}
        # Redis keeps the attempt's tensor metadata as ``run.tensors``: drop it all, write back the rest.
        drop = self._persist(run, status="running", drop_tensors=True, recovered=reason)
        return [*effects, drop, self._persist(run, status="running", tensors=kept)]

    def _restart(self, run: RequestRun, now: float, reason: str) -> list[Effect]:
        if run.restarts >= self.max_restarts:
            return self._fail(run, f"{reason}; gave up after {run.restarts} restarts", code="internal")
        log.warning("restarting request %s (attempt %d): %s", run.request_id, run.attempt + 1, reason)
        fresh = self._new_run(run.req, run.dag, run.attempt + 1, arrived=run.arrived, deadline=run.deadline)
        fresh.restarts = run.restarts + 1
        cancels = self._cancel_running(run.nodes.in_flight.values())
        self.runs[run.request_id] = fresh
        return [*cancels, ReleaseAttempt(run.ref), self._persist(fresh, status="queued", restarted=reason)]

    def _cancel_running(self, recs: Iterable[NodeRecord]) -> list[Effect]:
        """Stop the nodes ``recs`` that executors are still running: their attempt ended (failed or
        restarted) or they were put back (``_recover``). Their answers (``NodeFailed``) arrive stale
        and free the executors sooner. A real runner that cannot stop its thread lets the node finish
        (no ``restart_ok``); one that just ended or overran there is not cancelled."""
        return [
            SendCancel(ex.id, CancelNode(rec.ref.request_id, rec.ref.attempt, rec.ref.node_id))
            for rec in recs
            if (ex := self.executors.get(rec.executor or "")) is not None and ex.running == rec.ref
        ]

    def cancel(self, request_id: str, tenant: str, reason: str = "") -> list[Effect]:
        """The client cancelled a request in the core: nothing more of it is dispatched, its running
        nodes are cancelled and refunded (only the nodes that completed stay charged), its tensors
        are released, and it ends ``cancelled``. Idempotent: an unknown or ended request (or one of
        another tenant) is left alone."""
        run = self.runs.get(request_id)
        if run is None or run.req.tenant != tenant:
            return []
        log.info("request %s cancelled (%d of %d nodes done)", request_id, run.nodes.done, len(run.nodes))
        running = list(run.nodes.in_flight.values())
        refunds = [self.accounts.refund(tenant, r.charge_s) for r in running if not r.rerun]
        why = reason or "cancelled by the client"
        return [*refunds, *self._end(run, "cancelled", why, "cancelled")]

    def _succeed(self, run: RequestRun) -> list[Effect]:
        return self._end(run, "succeeded")

    def _fail(self, run: RequestRun, error: str, code: str) -> list[Effect]:
        log.warning("request %s failed: %s", run.request_id, error)
        return self._end(run, "failed", error, code)

    def _end(self, run: RequestRun, status: str, error: str = "", code: str = "") -> list[Effect]:
        # Executors still computing nodes of a failed run keep ``running`` set; their completions
        # arrive stale, free the executor and release the attempt's tensors again.
        cancels = self._cancel_running(run.nodes.in_flight.values())
        if self.runs.pop(run.request_id, None) is not None:
            self.accounts.request_ended(run.req.tenant)
        result = RequestResult(
            request_id=run.request_id,
            status=status,  # type: ignore[arg-type]
            images=dict(run.sinks) if status == "succeeded" else {},
            error=error,
            error_code=code,
            nodes=len(run.dag.nodes),
            executors=sorted(run.executors),
            bytes_moved=run.bytes_moved,
            gpu_s=progress.charged_s(run),
            nodes_run=run.nodes.done,
        )
        return [
            *cancels,
            ReleaseAttempt(run.ref),
            self._persist(run, status=status, drop_tensors=True, error=error),
            Finished(result, run.req.tenant),
        ]

    def _persist(self, run: RequestRun, status: str, **kw) -> PersistRequest:
        return persist(run, status, **kw)

    def tenant_stats(self) -> dict[str, dict[str, float | int]]:
        """The operator view: per tenant vTime, measured service, and its work in the system."""
        return views.tenant_stats(self.accounts, self.runs.values())

    def stats(self) -> dict[str, int]:
        return views.stats(self.executors.values(), self.runs.values())
