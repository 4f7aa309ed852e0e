"""The scheduler's asyncio shell: one inbox, one loop, one effect runner, and the lease.

Every input becomes a typed event (``events.py``) on one bounded inbox: requests taken in from
the JetStream intake (``intake.py``: a work queue with a durable pull consumer, so a request
survives a scheduler crash: it is acked only when it ends and kept alive with ``in_progress``
meanwhile), executor events (heartbeats, completions, failures; each executor only on its own
subject), dispatch answers (``dispatcher.py``), cancels (``control.py``) and the timer's ticks. The
inbox loop takes what has arrived, feeds it one event at a time to the state machine
(``machine.py``: ``handle(event, now) -> effects``), ends the batch with one ``Round`` (admission
and one scheduling round for all of it), and hands the effects to their handlers: dispatches to
the dispatcher, request state, vTime and executor messages to the outbox (batched), a finished
request to the finisher (``finish.py``: publish, make durable, ack; told once in
docs/scheduling.md, "The result"), the views to ``control.py``. The machine does no I/O and reads no
clock, so a recording of the inbox replays the run (``replay.py``).

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
from libs.common.metrics import SchedulerMetrics
from libs.common.registry_client import RegistryClient
from libs.common.service import run_all
from libs.common.watchdog import LoopWatchdog
from libs.protocol.ids import NodeRef
from libs.protocol.keys import Keys
from libs.protocol.messages import sched_decoder
from libs.protocol.subjects import Subjects
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.effects import (
    CancelDone,
    Effect,
    Finished,
    SendDispatch,
    StepDown,
    WriteBacklog,
    WriteViews,
)
from services.scheduler.core.events import BadCompletion, Event, FromExecutor, Round, Seed, Tick
from services.scheduler.core.machine import SchedulerMachine
from services.scheduler.core.scheduling import SchedulerCore
from services.scheduler.shell.control import Control
from services.scheduler.shell.dispatcher import Dispatcher
from services.scheduler.shell.finish import Finisher
from services.scheduler.shell.intake import Intake
from services.scheduler.shell.lease import Lease, LeaseLost
from services.scheduler.shell.outbox import Flushed, Outbox
from services.scheduler.shell.retrying import is_transient
from services.scheduler.shell.vtime_store import VTimeStore

log = logging.getLogger(__name__)


class _NodeEvent(msgspec.Struct):
    """The node an event names, read from one that did not validate (to treat the node as lost)."""

    type: str = ""
    executor: str = ""
    request_id: str = ""
    attempt: int = 0
    node_id: str = ""


INBOX_SIZE = 100_000  # events waiting at most; past it, their producers wait (backpressure)
BATCH = 1000  # events taken off the inbox per round at most
ROUND = Round()


class SchedulerService:
    def __init__(
        self,
        *,
        nc: Client,
        redis: Redis,
        subjects: Subjects,
        keys: Keys,
        machine: SchedulerMachine,
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
        self.machine = machine
        self.cfg = cfg
        self.lease = lease
        self.vtimes = VTimeStore(redis, keys)
        # Stalls of this event loop: observed, and the blocking code's stack logged (watchdog.py).
        self.watchdog = LoopWatchdog("scheduler", report_s=cfg.loop_report_s, observe=self.metrics.lagged)
        self._down = asyncio.Event()  # set when this leader must step down
        self._down_reason = ""
        self.inbox: asyncio.Queue[Event] = asyncio.Queue(maxsize=INBOX_SIZE)
        leading = lambda: self.leading  # noqa: E731 - read when called
        self.finisher = Finisher(
            nc=nc, redis=redis, subjects=subjects, keys=keys, cfg=cfg, metrics=self.metrics, leading=leading
        )
        self.intake = Intake(
            nc=nc,
            redis=redis,
            keys=keys,
            subjects=subjects,
            registry=RegistryClient(nc, subjects, timeout=cfg.registry_timeout_s),
            cfg=cfg,
            finish=self.finisher.finish_soon,
            post=self.inbox.put,
        )
        self.outbox = Outbox(
            nc=nc,
            redis=redis,
            subjects=subjects,
            keys=keys,
            vtimes=self.vtimes,
            lease=lease,
            request_ttl_s=cfg.request_ttl_s,
            leading=leading,
            step_down=self.step_down,
        )
        self.dispatcher = Dispatcher(
            nc=nc, subjects=subjects, lease=lease, leading=leading, post=self.inbox.put
        )
        self.control = Control(
            redis=redis,
            keys=keys,
            metrics=self.metrics,
            view_s=cfg.view_s,
            leading=leading,
            post=self.inbox.put,
        )
        self._subs: list = []
        self._pull: JetStreamContext.PullSubscription | None = None
        self.forged_events = 0  # events dropped: their ``executor`` was not their subject's sender

    @property
    def core(self) -> SchedulerCore:
        return self.machine.core

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
        self.inbox.put_nowait(Seed(vtime, ops, service))  # the first event this leader handles
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
        self._subs.append(await self.dispatcher.start())
        # Each executor publishes on its own events subject; ``_on_event`` holds it to that.
        self._subs.append(await self.nc.subscribe(self.subjects.sched_events, cb=self._on_event))
        self._subs.append(await self.nc.subscribe(self.subjects.cancels, cb=self.control.on_message))
        log.info("scheduler ready (namespace %s)", self.subjects.ns)

    async def run(self) -> None:
        """The long-lived loops; the service stops if any of them ends."""
        await run_all(
            self.lease_loop(),
            self.inbox_loop(),
            self.pull_loop(),
            self.outbox.run(),
            self.dispatcher.run(),
            self.tick_loop(),
            self.progress_loop(),
            self.control.poll_loop(),
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
        # Results being sent get a moment to go out and be acked; requests still being taken in
        # stay unacked: the next scheduler gets them.
        await self.finisher.stop()
        self.control.stop()
        for t in self.intake.taking.values():
            t.cancel()
        # A clean stop hands the lease over at once (a crash leaves it to expire after its TTL).
        await self.lease.release()

    # -- the inbox --------------------------------------------------------------------------------------
    async def inbox_loop(self) -> None:
        """Feed what has arrived to the machine one event at a time, end the batch with one round,
        and carry out the effects. Each event is handled at its own ``now``."""
        inbox, machine = self.inbox, self.machine
        while True:
            batch = [] if machine.more and self.leading else [await inbox.get()]
            while len(batch) < BATCH and not inbox.empty():
                batch.append(inbox.get_nowait())
            if not self.leading:  # stepped down: the lease loop ends run() at once
                continue
            effects: list[Effect] = []
            for ev in [*batch, ROUND]:
                try:
                    effects += machine.handle(ev, time.monotonic())
                except Exception:
                    log.exception("handling %s failed", type(ev).__name__)
            self._apply(effects)
            await asyncio.sleep(0)  # the NATS callbacks and the effect handlers run between batches

    def _apply(self, effects: list[Effect]) -> None:
        for e in effects:
            if not self.leading:  # stepped down: a newer leader acts now
                return
            match e:
                case SendDispatch():
                    self.dispatcher.send(e)
                    self.metrics.dispatched(e.msg)
                case Finished(result=result, tenant=tenant):
                    flushed = asyncio.Event()  # set once the effects queued before it were carried out
                    self.outbox.queue.put_nowait(Flushed(flushed))
                    m = self.intake.handles.pop(result.request_id, None)
                    self.finisher.finish_soon(result, tenant, m, flushed)
                case StepDown(reason=reason):
                    self.step_down(reason)
                case CancelDone(request_id=rid):
                    self.control.forget(rid)
                case WriteBacklog(counts=counts):
                    self.control.write_backlog(counts, time.monotonic())
                case WriteViews():
                    self.control.write_views(e)
                case _:
                    self.outbox.queue.put_nowait(e)  # in order: a callback's metadata follows its dispatch

    async def pull_loop(self) -> None:
        """Fetch intake messages while there is room (at most ``max_active`` requests in the core and
        ``max_backlog`` more held) and take them in (``intake.py``); beyond that they wait in
        JetStream (backpressure)."""
        while self._pull is not None:
            if not self.leading:  # stepped down: the lease loop ends run() at once
                await asyncio.sleep(self.cfg.tick_s)
                continue
            held = self.machine.held + self.intake.pending
            room = self.cfg.max_active + self.cfg.max_backlog - held
            if room <= 0:
                await asyncio.sleep(self.cfg.tick_s)
                continue
            try:
                msgs = await self._pull.fetch(batch=min(room, 128), timeout=1.0)
            except (NatsTimeoutError, TimeoutError):
                continue
            except Exception as e:
                if not is_transient(e):
                    raise  # the consumer is gone, say: the process exits and is restarted
                log.warning("fetching from the intake failed: %s: %s", type(e).__name__, e)
                await asyncio.sleep(self.cfg.tick_s)
                continue
            await self.intake.on_batch(msgs)

    # -- events ---------------------------------------------------------------------------------------
    async def _on_event(self, msg: Msg) -> None:
        if not self.leading:
            return
        sender = self.subjects.events_sender(msg.subject)
        try:
            ev = sched_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            await self._on_bad_event(msg.data, e, sender)
            return
        if ev.executor != sender:
            self._drop_forged(type(ev).__name__, ev.executor, sender)
            return
        await self.inbox.put(FromExecutor(ev))

    def _drop_forged(self, what: str, claimed: str, sender: str) -> None:
        """An event claiming another executor than its subject names: dropped (a forgery, or a bug)."""
        self.forged_events += 1
        log.warning(
            "dropped a %s claiming executor %r on the events subject of %r (%d dropped so far)",
            what, claimed, sender, self.forged_events,
        )  # fmt: skip

    async def _on_bad_event(self, data: bytes, e: msgspec.DecodeError, sender: str) -> None:
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
        await self.inbox.put(BadCompletion(node, ev.executor, str(e)))

    # -- timers -----------------------------------------------------------------------------------------
    async def tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            await self.inbox.put(Tick(time.time()))

    async def progress_loop(self) -> None:
        """Keep intake messages from being redelivered while their request is taken in or runs."""
        while True:
            await asyncio.sleep(self.cfg.ack_wait_s / 3)
            # Every request taken in and not acked yet: its take-in retrying, queued, running, or
            # its end being made durable (``finish.py``). The one keep-alive of intake messages.
            for rid, m in [*self.intake.handles.items(), *self.finisher.finishing.items()]:
                try:
                    await m.in_progress()
                except Exception as e:  # noqa: BLE001
                    log.warning("in_progress for %s failed: %s", rid, e)
