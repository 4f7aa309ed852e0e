"""The scheduler's asyncio shell: NATS, Redis and timers around :class:`SchedulerCore`.

Inputs: image requests from the JetStream intake (a work queue with a durable pull consumer, so a
request survives a scheduler crash: it is acked only when it ends and kept alive with
``in_progress`` meanwhile; taking one in is ``intake.py``), and executor events (heartbeats,
completions, failures). Every input becomes one synchronous call on the core; the returned effects
are carried out here: dispatches are sent as request/reply to the executor (its ``Ack`` or silence
goes back into the core), request state is written to Redis, results are published to the gateway.

How a request ends is told once, in docs/scheduling.md ("The result"): the result is published,
the request's end is made durable (the effects queued before it carried out, the result stored in
Redis, retried, the intake message kept alive meanwhile), and only then is the message acked
(:meth:`SchedulerService._finish`).

Only the leader acts (``lease.py``, ``docs/scheduling.md`` "Fail-over"): :meth:`start` waits (a
standby) until it holds the scheduler lease; then every dispatch, cancel and release it sends
carries its lease epoch, and so does every vTime write, and dispatches and vTime writes wait while
the lease is not certainly valid (its keeper thread renews it off this loop, so a stalled loop does
not lose it). It steps down — the long-lived loops end with :class:`LeaseLost`, and
``succession.py`` builds a fresh service that waits as a standby — when the keeper finds the lease
gone or could not reach Redis for a whole TTL, or when it is told its epoch is stale (by the vTime
script, or by an executor refusing a dispatch).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from redis.asyncio import Redis

from libs.common.jetstream import ensure_intake_stream
from libs.common.logs import bind_request
from libs.common.metrics import SchedulerMetrics
from libs.common.registry_client import RegistryClient
from libs.common.service import run_all
from libs.common.watchdog import LoopWatchdog
from libs.protocol.ids import NodeRef
from libs.protocol.keys import Keys
from libs.protocol.messages import (
    STALE_EPOCH,
    ExecutorGoodbye,
    ExecutorHeartbeat,
    ImageRequest,
    LiveAttempts,
    NodeComplete,
    NodeFailed,
    RequestResult,
    encode,
    sched_decoder,
)
from libs.protocol.subjects import Subjects
from libs.workflow.dag import Dag
from services.scheduler.admission import rank_for
from services.scheduler.config import SchedulerConfig
from services.scheduler.control import Control
from services.scheduler.core import SchedulerCore
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.effects import (
    Effect,
    Finished,
    SendDispatch,
)
from services.scheduler.intake import Intake
from services.scheduler.lease import Lease, LeaseLost
from services.scheduler.outbox import EVENTS_MAXLEN, EVENTS_TTL_S, Flushed, Outbox
from services.scheduler.progress import end_event
from services.scheduler.retrying import Backoff, is_transient, retry_transient
from services.scheduler.views import live_attempts
from services.scheduler.vtime_store import VTimeStore

log = logging.getLogger(__name__)


class _NodeEvent(msgspec.Struct):
    """The node an event names, read from one that did not validate (to treat the node as lost)."""

    type: str = ""
    executor: str = ""
    request_id: str = ""
    attempt: int = 0
    node_id: str = ""


class SchedulerService:
    def __init__(
        self,
        *,
        nc: Client,
        redis: Redis,
        subjects: Subjects,
        keys: Keys,
        core: SchedulerCore,
        cfg: SchedulerConfig,
        lease: Lease,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.nc = nc
        self.metrics = metrics or SchedulerMetrics()  # observed here in the shell, never in the core
        self.js = nc.jetstream()
        self.redis = redis
        self.subjects = subjects
        self.keys = keys
        self.core = core
        self.cfg = cfg
        self.registry = RegistryClient(nc, subjects, timeout=cfg.registry_timeout_s)
        self.vtimes = VTimeStore(redis, keys)
        self.lease = lease
        # Stalls of this event loop: observed, and the blocking code's stack logged (watchdog.py).
        self.watchdog = LoopWatchdog("scheduler", report_s=cfg.loop_report_s, observe=self.metrics.lagged)
        self._down = asyncio.Event()  # set when this leader must step down
        self._down_reason = ""
        self.intake = Intake(
            nc=nc,
            redis=redis,
            keys=keys,
            subjects=subjects,
            registry=self.registry,
            cfg=cfg,
            finish=self._finish_soon,
            admit=self._admit,
        )
        self.outbox = Outbox(self)
        self.dispatcher = Dispatcher(self)
        self._io = self.outbox.queue
        self._schedule_due = False  # a scheduling round is queued for this loop iteration
        self._tasks: set[asyncio.Task] = set()
        self._finishing: set[asyncio.Task] = set()  # results being published, acked and stored
        self.finishing: dict[str, Msg] = {}  # their intake messages, kept alive until acked
        self._subs: list = []
        self._pull: JetStreamContext.PullSubscription | None = None
        self.forged_events = 0  # events dropped: their ``executor`` was not their subject's sender
        self.control = Control(self)  # clients' cancels, the executors view (control.py)

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def leading(self) -> bool:
        """Whether this scheduler holds the lease and acts on it."""
        return self.lease.held and not self._down.is_set()

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    async def _acquire_lease(self) -> None:
        """Wait (a standby: the lease's keeper thread polls every ``lease_poll_s``) until this
        scheduler holds the lease; from then on the keeper renews it, and tells :meth:`step_down`
        if it is lost."""
        await self.lease.acquire(on_lost=self.step_down)
        self.vtimes.epoch = self.intake.epoch = self.lease.epoch
        self.metrics.leading.set(1)
        log.info(
            "scheduler lease taken: leading with epoch %d (holder %s)", self.lease.epoch, self.lease.holder
        )

    def step_down(self, reason: str) -> None:
        """Stop acting at once: nothing more is fetched or dispatched; ``run`` raises LeaseLost."""
        if not self._down.is_set():
            self.metrics.leading.set(0)
            self._down_reason = reason
            self._down.set()
            log.error("stepping down as the leading scheduler (epoch %d): %s", self.lease.epoch, reason)

    async def start(self) -> None:
        self.watchdog.start()
        await self._acquire_lease()
        vtime, ops, service = await self.vtimes.load()
        self.core.accounts.load(vtime, ops, service)
        if vtime:
            log.info(
                "resumed tenant vTime from Redis: %s", {t: round(v, 3) for t, v in sorted(vtime.items())}
            )
        await ensure_intake_stream(self.js, self.subjects)
        consumer = ConsumerConfig(
            durable_name=self.subjects.intake_durable,
            filter_subject=self.subjects.intake,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.cfg.ack_wait_s,
            # No delivery limit: transient failures keep the message instead of nak-ing it, and
            # intake.py answers one delivered more than max_deliveries times (never drops it).
            max_deliver=-1,
            # Every message held (in the core, queued for admission, being taken in) is unacked.
            max_ack_pending=max(2 * (self.cfg.max_active + self.cfg.max_backlog), 100),
        )
        # Create, or update one an older scheduler made (it had max_deliver=5): pull_subscribe alone
        # binds to an existing durable without changing it.
        await self.js.add_consumer(self.subjects.intake_stream, config=consumer)
        self._pull = await self.js.pull_subscribe(
            self.subjects.intake,
            durable=self.subjects.intake_durable,
            stream=self.subjects.intake_stream,
            config=consumer,
        )
        await self.dispatcher.start()
        # Each executor publishes on its own events subject; ``_on_event`` holds it to that.
        self._subs.append(await self.nc.subscribe(self.subjects.sched_events, cb=self._on_event))
        self._subs.append(await self.nc.subscribe(self.subjects.cancels, cb=self.control.on_message))
        log.info("scheduler ready (namespace %s)", self.subjects.ns)

    async def run(self) -> None:
        """The long-lived loops; the service stops if any of them ends."""
        await run_all(
            self.lease_loop(),
            self.intake_loop(),
            self.io_loop(),
            self.dispatcher.run(),
            self.tick_loop(),
            self.progress_loop(),
            self.control.run(),
        )

    async def lease_loop(self) -> None:
        """End ``run`` with :class:`LeaseLost` once this scheduler steps down (the lease's keeper
        thread renews the lease, off this loop: ``lease.py``)."""
        await self._down.wait()
        raise LeaseLost(f"{self._down_reason}: starting again as a standby")

    async def stop(self) -> None:
        self.watchdog.stop()
        if self._pull is not None:
            # nats-py's drain waits for a pull subscription's queue to empty, which status messages
            # arriving after the last fetch never do: unsubscribe it first.
            try:
                await self._pull.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone
                pass
            self._pull = None
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone
                pass
        self._subs.clear()
        # Results being sent get a moment to go out and be acked (then only their Redis copy is
        # cut short); requests still being taken in stay unacked: the next scheduler gets them.
        if self._finishing:
            await asyncio.wait(self._finishing, timeout=2.0)
        for t in [*self._tasks, *self._finishing, *self.intake.taking.values()]:
            t.cancel()
        # A clean stop hands the lease over at once (a crash leaves it to expire after its TTL).
        await self.lease.release()

    # -- intake ---------------------------------------------------------------------------------------
    async def intake_loop(self) -> None:
        """Pull requests into the backlog, and admit them from it to the core (``admission.py``)."""
        await run_all(self._pull_loop(), self._admission_loop())

    async def _pull_loop(self) -> None:
        while self._pull is not None:
            if not self.leading:  # stepped down: the lease loop ends run() at once
                await asyncio.sleep(self.cfg.tick_s)
                continue
            # At most max_active requests in the core and max_backlog more held here.
            held = self.core.active + self.intake.held
            room = self.cfg.max_active + self.cfg.max_backlog - held
            if room <= 0:
                await asyncio.sleep(self.cfg.tick_s)  # backpressure: requests wait in JetStream
                continue
            try:
                msgs = await self._pull.fetch(batch=min(room, 128), timeout=1.0)  # type: ignore[union-attr]
            except (NatsTimeoutError, TimeoutError):
                continue
            except Exception as e:
                if not is_transient(e):
                    raise  # the consumer is gone, say: the process exits and is restarted
                log.warning("fetching from the intake failed: %s: %s", type(e).__name__, e)
                await asyncio.sleep(self.cfg.tick_s)
                continue
            await self.intake.on_batch(msgs)

    async def _admission_loop(self) -> None:
        """Admit queued requests while the core has room, in the policy's order; answer those whose
        deadline passes in the queue. Woken when a request is queued or leaves the core."""
        rank = rank_for(self.cfg.policy, self.cfg.slack_s)
        wake = self.intake.wake
        last_expiry = 0.0
        while True:
            try:
                await asyncio.wait_for(wake.wait(), self.cfg.tick_s)
            except TimeoutError:
                pass
            wake.clear()
            now = time.monotonic()
            try:
                if now - last_expiry >= self.cfg.tick_s:
                    last_expiry = now
                    self.intake.expire_queued(now)
                room = self.cfg.max_active - self.core.active
                if room > 0 and len(self.intake.backlog):
                    # A few at a time (each runs a scheduling round), then let the loop breathe.
                    self.intake.admit_queued(min(room, 64), rank, self.core.accounts.tenants, now)
                    if room > 64 and len(self.intake.backlog):
                        wake.set()
            except Exception:
                log.exception("admitting queued requests failed")
            await asyncio.sleep(0)

    def _admit(self, req: ImageRequest, dag: Dag, attempt: int, deadline: float) -> None:
        now = time.monotonic()
        self._apply(self.core.add_request(req, dag, attempt=attempt, now=now, deadline=deadline))
        self._schedule_soon()

    def _schedule_soon(self) -> None:
        """Run one scheduling round once the events at hand are taken in (coalesced: events that
        arrive together — completions, answers, heartbeats, admissions — share one round instead
        of a snapshot and a policy call each; docs/scheduling.md, "Control-plane speed")."""
        if not self._schedule_due:
            self._schedule_due = True
            asyncio.get_running_loop().call_soon(self._schedule_now)

    def _schedule_now(self) -> None:
        self._schedule_due = False
        try:
            self._apply(self.core.schedule(time.monotonic()))
        except Exception:
            log.exception("scheduling round failed")

    # -- events ---------------------------------------------------------------------------------------
    async def _on_event(self, msg: Msg) -> None:
        if not self.leading:
            return
        sender = self.subjects.events_sender(msg.subject)
        try:
            ev = sched_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            self._on_bad_event(msg.data, e, sender)
            return
        if ev.executor != sender:
            self._drop_forged(type(ev).__name__, ev.executor, sender)
            return
        now = time.monotonic()
        try:
            match ev:
                case ExecutorHeartbeat():
                    effects = self.core.on_heartbeat(ev, now)
                case NodeComplete():
                    effects = self.core.on_complete(ev, now)
                case NodeFailed():
                    effects = self.core.on_failed(ev, now)
                case ExecutorGoodbye(executor=ex):
                    effects = self.core.remove_executor(ex, now, "said goodbye")
            self._apply(effects)
            self._schedule_soon()
        except Exception:
            log.exception("handling %s failed", type(ev).__name__)

    def _drop_forged(self, what: str, claimed: str, sender: str) -> None:
        """An event claiming another executor than its subject names: dropped (a forgery, or a bug)."""
        self.forged_events += 1
        log.warning(
            "dropped a %s claiming executor %r on the events subject of %r (%d dropped so far)",
            what, claimed, sender, self.forged_events,
        )  # fmt: skip

    def _on_bad_event(self, data: bytes, e: msgspec.DecodeError, sender: str) -> None:
        """An event that did not validate is dropped; if it is a completion (say, with a negative or
        non-finite time), the node it names is treated as lost and runs again."""
        try:
            ev = msgspec.json.decode(data, type=_NodeEvent)
            node = NodeRef(ev.request_id, ev.attempt, ev.node_id) if ev.type == "node_complete" else None
        except (msgspec.DecodeError, UnicodeDecodeError, ValueError):
            node = None
        if node is None or not ev.executor:
            log.warning("dropped a malformed event: %s", e)
            return
        if ev.executor != sender:
            self._drop_forged(f"malformed {ev.type}", ev.executor, sender)
            return
        now = time.monotonic()
        try:
            self._apply(self.core.reject_completion(node, ev.executor, now, str(e)))
            self._schedule_soon()
        except Exception:
            log.exception("handling the bad completion of %s failed", node)

    # -- effects ----------------------------------------------------------------------------------------
    def _apply(self, effects: list[Effect]) -> None:
        if not self.leading:  # stepped down: a newer leader acts now
            return
        for e in effects:
            if isinstance(e, SendDispatch):
                self.dispatcher.send(e)
                self.metrics.dispatched(e.msg)
            elif isinstance(e, Finished):  # at once: a Redis outage must not hold the answer up
                flushed = asyncio.Event()  # set once the effects queued before it were carried out
                self._io.put_nowait(Flushed(flushed))
                self._finish_soon(
                    e.result, e.tenant, self.intake.handles.pop(e.result.request_id, None), flushed
                )
            else:
                self._io.put_nowait(e)  # in order: a callback's metadata follows its dispatch

    def on_dispatch_answer(self, node: NodeRef, executor: str, ok: bool, seq: int, error: str) -> None:
        """An executor answered a dispatch, or did not in time (``dispatcher.py``)."""
        if not self.leading:
            return
        if not ok and error == STALE_EPOCH:
            self.step_down(f"executor {executor} refused dispatch {node}: a newer scheduler has led it")
            return
        now = time.monotonic()
        try:
            effects = self.core.dispatch_result(node, executor, ok=ok, seq=seq, error=error, now=now)
        except Exception:
            log.exception("handling the answer to dispatch %s failed", node)
            return
        self._apply(effects)
        if not ok:  # an accepted dispatch frees nothing: only a refused one needs a new round
            self._schedule_soon()

    async def io_loop(self) -> None:
        await self.outbox.run()

    def _spawn(self, coro, tasks: set[asyncio.Task] | None = None) -> None:
        into = self._tasks if tasks is None else tasks
        t = asyncio.create_task(coro)
        into.add(t)
        t.add_done_callback(into.discard)

    def _finish_soon(
        self, result: RequestResult, tenant: str, m: Msg | None, flushed: asyncio.Event | None = None
    ) -> None:
        self._spawn(self._finish(result, tenant, m, flushed), self._finishing)
        self.intake.wake.set()  # a request left the core (or the intake): room to admit another

    async def _finish(
        self, result: RequestResult, tenant: str, m: Msg | None, flushed: asyncio.Event | None = None
    ) -> None:
        """Publish the result (the answer is not held up), then make the request's end durable —
        the charges and state queued before it carried out, the result stored in Redis (retried) —
        and only then ack the intake message, kept alive meanwhile: a scheduler that dies before
        the ack leaves the message to the next one, which finds the result in Redis (or, if it was
        never stored, runs the request again); it never leaves a request answered but unrecorded."""
        rid = result.request_id
        bind_request(rid)  # this task's log lines (the result's among them) carry the request id
        self.metrics.finished(result, tenant)
        data = encode(result)
        try:
            await self.nc.publish(self.subjects.result(rid), data)
        except Exception as ex:  # noqa: BLE001 - the gateway also polls Redis for it
            log.warning("publishing the result of %s failed: %s; it goes to Redis", rid, ex)
        if m is not None:
            self.finishing[rid] = m  # kept alive by progress_loop, as while it was taken in or ran
        try:
            if flushed is not None:
                await flushed.wait()
            await self._store_result(result, tenant, data)
        finally:
            self.finishing.pop(rid, None)
        if m is not None and self.leading:
            try:
                await retry_transient(m.ack, f"acking {rid}", backoff=self._backoff(), give_up_after_s=10.0)
            except Exception as ex:  # noqa: BLE001 - a redelivery finds the result in Redis
                log.warning("ack of %s failed: %s", rid, ex)

    async def _store_result(self, result: RequestResult, tenant: str, data: bytes) -> None:
        rid = result.request_id
        log.info(
            "request %s %s: %d nodes on %s, %d bytes moved, %.3fs executor time%s",
            rid,
            result.status,
            result.nodes,
            ",".join(result.executors) or "-",
            result.bytes_moved,
            result.gpu_s,
            f" ({result.error_code}: {result.error})" if result.error else "",
        )
        key, events = self.keys.request(rid), self.keys.events(rid)

        async def store() -> None:
            pipe = self.redis.pipeline(transaction=False)  # both idempotent; MULTI is not in its ACL
            fields = {"status": result.status, "result": data} | ({"tenant": tenant} if tenant else {})
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self.cfg.request_ttl_s)
            # The progress stream's last entry, after every node's (they were flushed before this).
            end = msgspec.json.encode({**end_event(result), "t": round(time.time(), 3)})
            pipe.xadd(events, {"data": end}, maxlen=EVENTS_MAXLEN, approximate=True)
            pipe.expire(events, EVENTS_TTL_S)
            await pipe.execute()

        try:
            await retry_transient(
                store,
                f"storing the result of {rid}",
                backoff=self._backoff(),
                give_up_after_s=self.cfg.result_retry_s,
            )
        except Exception:
            log.exception("storing the result of %s in Redis failed for good", rid)

    def _backoff(self) -> Backoff:
        return Backoff(self.cfg.retry_initial_s, self.cfg.retry_max_s)

    # -- timers ---------------------------------------------------------------------------------------------
    async def tick_loop(self) -> None:
        last_stats = last_view = last_reconcile = 0.0
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            now = time.monotonic()
            try:
                self._apply(self.core.expire(now) + self.core.schedule(now))
            except Exception:
                log.exception("scheduler tick failed")
            if self.cfg.reconcile_s > 0 and now - last_reconcile >= self.cfg.reconcile_s and self.leading:
                last_reconcile = now
                await self._publish_live_attempts()
            if now - last_view >= self.cfg.view_s:
                last_view = now
                await self._publish_tenants(log_it=now - last_stats > 10.0)
                if now - last_stats > 10.0:
                    last_stats = now
                    log.info("state: %s", self.core.stats())

    async def _publish_live_attempts(self) -> None:
        """Tell executors which attempts are in progress, so they free any other (a lost release)."""
        live = LiveAttempts(live_attempts(self.core.runs.values()), epoch=self.epoch)
        try:
            await self.nc.publish(self.subjects.executors_all, encode(live))
        except Exception as e:  # noqa: BLE001 - sent again next period
            log.warning("broadcasting the live attempts failed: %s", e)

    async def _publish_tenants(self, log_it: bool) -> None:
        """The operator view: per-tenant vTime, service and queued/running work, in Redis."""
        view = self.core.tenant_stats()
        self.metrics.tenants(view, self.intake.backlog.counts())
        if not view:
            return
        try:
            await self.redis.hset(
                self.keys.tenants, mapping={t: msgspec.json.encode(v) for t, v in view.items()}
            )
        except Exception as e:  # noqa: BLE001 - the view is refreshed next second
            log.warning("writing the tenant view failed: %s", e)
        if log_it:
            for tenant, v in sorted(view.items()):
                log.info("tenant %s: %s", tenant, " ".join(f"{k}={v[k]}" for k in sorted(v)))

    async def progress_loop(self) -> None:
        """Keep intake messages from being redelivered while their request is taken in or runs."""
        while True:
            await asyncio.sleep(self.cfg.ack_wait_s / 3)
            # Every request taken in and not acked yet: its take-in retrying, queued, running, or
            # its end being made durable (``_finish``). The one keep-alive of intake messages.
            for rid, m in [*self.intake.handles.items(), *self.finishing.items()]:
                try:
                    await m.in_progress()
                except Exception as e:  # noqa: BLE001
                    log.warning("in_progress for %s failed: %s", rid, e)
