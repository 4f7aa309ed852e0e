"""The scheduler as one state machine: ``handle(event, now) -> effects``, no I/O, no clock.

:class:`SchedulerMachine` owns a request's whole life once it is taken in: the backlog and the
order of admission (``admission.py``), the per-tenant backlog limit, deadlines (in the backlog and
in the core), cancels (wherever the request is), the dispatches in flight and their timeouts, and
the periodic views. :class:`~services.scheduler.core.scheduling.SchedulerCore` is the part that runs admitted
requests (placement, completions, lineage, accounting). The shell (``service.py``) turns NATS
messages, answers and timers into :mod:`~services.scheduler.core.events`, feeds them in one at a time
from one inbox, and carries out what comes back; so a recording of the inbox replays a run
exactly (``replay.py``).

What stays with the shell is what needs I/O before there is anything to decide: decoding an intake
message, reading its stored state and resolving its workflow at the registry (``intake.py``, which
posts :class:`~services.scheduler.core.events.TakenIn` or answers the request itself), and keeping intake
messages alive until they are acked.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from libs.protocol.ids import NodeRef
from libs.protocol.messages import (
    STALE_EPOCH,
    ExecutorGoodbye,
    ExecutorHeartbeat,
    NodeComplete,
    NodeFailed,
    RequestResult,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.admission import Backlog, Queued, rank_for
from services.scheduler.core.effects import (
    BroadcastLive,
    CancelDone,
    Effect,
    Finished,
    SendDispatch,
    StepDown,
    WriteBacklog,
    WriteViews,
)
from services.scheduler.core.events import (
    BadCompletion,
    Cancel,
    DispatchAnswer,
    Event,
    FromExecutor,
    Round,
    Seed,
    TakenIn,
    Tick,
)
from services.scheduler.core.scheduling import SchedulerCore
from services.scheduler.core.views import BusyMeter, executors_view, live_attempts

log = logging.getLogger(__name__)

ADMIT_PER_ROUND = 64  # admissions per round (each a DAG added to the core); more wait a round
STATS_EVERY_S = 10.0  # how often the state summary is logged


def failed(rid: str, error: str, code: str) -> RequestResult:
    return RequestResult(rid, "failed", error=error, error_code=code)


def cancelled(rid: str, reason: str = "", nodes: int = 0) -> RequestResult:
    """The answer to a request cancelled before any of its nodes ran (nothing charged)."""
    return RequestResult(
        rid, "cancelled", error=reason or "cancelled by the client", error_code="cancelled", nodes=nodes
    )


class SchedulerMachine:
    def __init__(self, core: SchedulerCore, cfg: SchedulerConfig) -> None:
        self.core = core
        self.cfg = cfg
        self.backlog = Backlog()  # taken in, waiting for admission to the core
        self.rank = rank_for(cfg.policy, cfg.slack_s)
        # token -> (node, executor, deadline), in the order sent (so deadlines are in order too)
        self.pending: OrderedDict[int, tuple[NodeRef, str, float]] = OrderedDict()
        self._token = 0
        self.busy = BusyMeter()
        self.cancelled = 0  # requests this leader answered ``cancelled``
        self._due = False  # a scheduling round is due (something it reads changed)
        self._last_view = self._last_live = self._last_stats = -float("inf")

    @property
    def held(self) -> int:
        """Requests this leader holds: in the core or waiting for admission."""
        return self.core.active + len(self.backlog)

    @property
    def more(self) -> bool:
        """Whether another :class:`Round` would admit more (the last one stopped at its quota)."""
        return bool(len(self.backlog)) and self.core.active < self.cfg.max_active

    def handle(self, event: Event, now: float) -> list[Effect]:
        match event:
            case Round():
                return self._round(now)
            case FromExecutor(event=ev):
                self._due = True
                return self._from_executor(ev, now)
            case DispatchAnswer():
                return self._answered(event, now)
            case TakenIn(item=item):
                return self._queue(item)
            case Cancel(request_id=rid, tenant=tenant, reason=reason):
                return self._cancel(rid, tenant, reason)
            case Tick(wall=wall):
                self._due = True
                return self._tick(now, wall)
            case BadCompletion(node=node, executor=ex, problem=problem):
                self._due = True
                return self.core.reject_completion(node, ex, now, problem)
            case Seed(vtime=vtime, ops=ops, service=service):
                self.core.accounts.load(vtime, ops, service)
                return []
        raise TypeError(f"not a scheduler event: {event!r}")

    # -- rounds -------------------------------------------------------------------------------------
    def _round(self, now: float) -> list[Effect]:
        effects = self._admit(now)
        if self._due:
            self._due = False
            effects += self.core.schedule(now)
        return self._stamp(effects, now)

    def _admit(self, now: float) -> list[Effect]:
        """Hand queued requests to the core while it has room, in the policy's order (``rank``
        reads the core's accounts afresh for each pick: an admission may lift a tenant)."""
        effects: list[Effect] = []
        room = min(self.cfg.max_active - self.core.active, ADMIT_PER_ROUND)
        while room > 0 and (item := self.backlog.pop(self.rank, self.core.accounts.tenants)) is not None:
            if now >= item.deadline:
                effects.append(
                    Finished(failed(item.req.request_id, _late(item, now), "timeout"), item.tenant)
                )
                continue
            try:
                effects += self.core.add_request(
                    item.req, item.dag, attempt=item.attempt, now=now, deadline=item.deadline
                )
            except Exception as e:
                log.exception("admitting %s failed", item.req.request_id)
                why = f"internal error: {type(e).__name__}: {e}"
                effects.append(Finished(failed(item.req.request_id, why, "internal"), item.tenant))
                continue
            self._due = True
            room -= 1
        return effects

    def _stamp(self, effects: list[Effect], now: float) -> list[Effect]:
        """Give each new dispatch its token and deadline, and remember it until it is answered."""
        deadline = now + self.cfg.dispatch_timeout_s
        for i, e in enumerate(effects):
            if isinstance(e, SendDispatch) and e.token == 0:
                self._token += 1
                self.pending[self._token] = (e.msg.ref, e.executor, deadline)
                effects[i] = SendDispatch(e.executor, e.msg, self._token, deadline)
        return effects

    # -- executors ----------------------------------------------------------------------------------
    def _from_executor(
        self, ev: ExecutorHeartbeat | NodeComplete | NodeFailed | ExecutorGoodbye, now: float
    ) -> list[Effect]:
        match ev:
            case ExecutorHeartbeat():
                return self.core.on_heartbeat(ev, now)
            case NodeComplete():
                return self.core.on_complete(ev, now)
            case NodeFailed():
                return self.core.on_failed(ev, now)
            case ExecutorGoodbye(executor=ex):
                return self.core.remove_executor(ex, now, "said goodbye")
        raise TypeError(f"not an executor event: {ev!r}")

    def _answered(self, a: DispatchAnswer, now: float) -> list[Effect]:
        found = self.pending.pop(a.token, None)
        if found is None:  # answered after its timeout (already treated as unanswered)
            return []
        node, executor, _ = found
        if not a.ok and a.error == STALE_EPOCH:
            return [StepDown(f"executor {executor} refused dispatch {node}: a newer scheduler has led it")]
        if not a.ok:  # an accepted dispatch frees nothing: only a refused one needs a new round
            self._due = True
        return self.core.dispatch_result(node, executor, ok=a.ok, seq=a.seq, error=a.error, now=now)

    def _timed_out(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        while self.pending:
            token, (node, executor, deadline) = next(iter(self.pending.items()))
            if deadline > now:
                break
            del self.pending[token]
            effects += self.core.dispatch_result(
                node, executor, ok=False, seq=0, error="no answer (TimeoutError)", now=now
            )
        return effects

    # -- requests -----------------------------------------------------------------------------------
    def _queue(self, item: Queued) -> list[Effect]:
        """Queue a request taken in, or answer ``rate_limited`` when its tenant has
        ``max_tenant_backlog`` queued already (docs/scheduling.md, "Per-tenant limits")."""
        cap = self.cfg.max_tenant_backlog
        if cap > 0 and (queued := self.backlog.count(item.tenant)) >= cap:
            why = (
                f"tenant {item.tenant!r} has {queued} requests queued at the scheduler, its limit "
                f"(max_tenant_backlog {cap}); retry once some have started"
            )
            return [Finished(failed(item.req.request_id, why, "rate_limited"), item.tenant)]
        self.backlog.push(item)
        return []

    def _cancel(self, rid: str, tenant: str | None, reason: str) -> list[Effect]:
        """Cancel a request this leader holds, in the core or in the backlog (``tenant`` None:
        trusted, the request's own). Nothing when it holds none of that id and tenant (ended, not
        taken in yet — the take-in reads the cancel flag — or another tenant's)."""
        run = self.core.runs.get(rid)
        queued = None if run is not None else next((q for q in self.backlog if q.req.request_id == rid), None)
        owner = run.req.tenant if run is not None else queued.tenant if queued is not None else None
        if owner is None or (tenant is not None and tenant != owner):
            if owner is not None:
                log.warning("ignored a cancel of %s for tenant %r: it is %r's", rid, tenant, owner)
            return []
        self.cancelled += 1
        if run is not None:
            self._due = True  # its executors are free (or soon): others' work goes there
            return [*self.core.cancel(rid, owner, reason), CancelDone(rid)]
        assert queued is not None
        self.backlog.remove(rid)
        return [Finished(cancelled(rid, reason, len(queued.dag.nodes)), owner), CancelDone(rid)]

    # -- time ---------------------------------------------------------------------------------------
    def _tick(self, now: float, wall: float) -> list[Effect]:
        effects = self._timed_out(now) + self.core.expire(now)
        for item in self.backlog.expired(now):
            effects.append(Finished(failed(item.req.request_id, _late(item, now), "timeout"), item.tenant))
        counts = self.backlog.counts()
        effects.append(WriteBacklog(counts))
        self.busy.sample(self.core.executors, now)
        cfg = self.cfg
        if cfg.reconcile_s > 0 and now - self._last_live >= cfg.reconcile_s:
            self._last_live = now
            effects.append(BroadcastLive(live_attempts(self.core.runs.values())))
        if now - self._last_view >= cfg.view_s:
            self._last_view = now
            stats = None
            if now - self._last_stats >= STATS_EVERY_S:
                self._last_stats = now
                stats = self.core.stats()
            view = executors_view(self.core.executors, self.busy.busy, now, wall)
            effects.append(WriteViews(self.core.tenant_stats(), counts, view, stats))
        return effects


def _late(item: Queued, now: float) -> str:
    return (
        f"deadline passed while queued for admission ({item.req.timeout_s:g}s after submission, "
        f"{now - item.deadline:.1f}s ago)"
    )
