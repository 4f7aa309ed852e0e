"""Clients' cancels and the operator's executors view: the shell's side of both (``service.py``).

*Cancel* (``docs/scheduling.md``, "Cancel and progress"). The gateway flags the request in Redis — field
``cancel`` of ``{ns}:req:{id}`` and an entry in the sorted set ``{ns}:cancels`` — and then
publishes a :class:`CancelRequest` on ``{ns}.sched.cancel``. The message makes the cancel immediate;
the flags make it survive what core NATS does not promise:

* a request still in JetStream (not taken in yet, or handed to a new leader after a fail-over) is
  answered ``cancelled`` at take-in, which reads the request hash anyway (``intake.py``);
* a lost message, or one that raced a request's take-in, is caught by polling ``{ns}:cancels``
  every ``POLL_S`` for the requests this leader holds; entries older than ``KEEP_S`` are trimmed
  (by then the take-in check covers the request).

Both become a :class:`~services.scheduler.core.events.Cancel` on the scheduler's inbox; the state machine
cancels the request wherever it is (``machine.py``: in the core, its running nodes are cancelled
and refunded; in the backlog, it is answered at once) and says so with ``CancelDone``, whose poll
entry is then removed. Cancelling an ended or unknown request does nothing. The message's tenant
must be the request's (a poll entry, written by the gateway after its own tenant check, is
trusted).

*Views.* The machine hands over, every ``view_s``, the operator views: ``{ns}:executors``
(executor id -> JSON, ``views.executors_view``) for ``GET /v1/admin/executors``, the CLI's ``top``
and the console, an executor that left removed from it; ``{ns}:tenants`` (per-tenant vTime,
service and work); and, every tick, the backlog's per-tenant counts for ``{ns}:backlog`` (the
gateway's per-tenant queued limit; a short TTL, so a dead scheduler's counts vanish). A new leader
replaces each hash on its first write. A write still under way when the next view comes skips it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine

import msgspec
from nats.aio.msg import Msg
from redis.asyncio import Redis

from libs.common.metrics import SchedulerMetrics
from libs.protocol.keys import Keys
from libs.protocol.messages import cancel_decoder
from services.scheduler.core.effects import WriteViews
from services.scheduler.core.events import Cancel
from services.scheduler.shell.intake import REQUEST_ID

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often ``{ns}:cancels`` is read (a cancel whose message was lost waits this long)
KEEP_S = 120.0  # entries older than this are trimmed from ``{ns}:cancels``


class Control:
    def __init__(
        self,
        *,
        redis: Redis,
        keys: Keys,
        metrics: SchedulerMetrics,
        view_s: float,
        leading: Callable[[], bool],
        post: Callable[[Cancel], Awaitable[None]],
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.metrics = metrics
        self.view_s = view_s
        self.leading = leading
        self.post = post
        self._done: set[str] = set()  # cancels carried out: their poll entries to remove
        self._written: set[str] | None = None  # executor ids in ``{ns}:executors`` (None: never)
        self._writing: dict[str, asyncio.Task] = {}  # what -> its write under way
        self._backlog: dict[str, int] | None = None  # backlog counts last written (None: never)
        self._backlog_at = -float("inf")  # monotonic
        self._backlog_failed = False

    # -- cancel -----------------------------------------------------------------------------------
    async def on_message(self, msg: Msg) -> None:
        """A ``CancelRequest`` from the gateway (validated; a bad one is logged and dropped)."""
        if not self.leading():
            return
        try:
            m = cancel_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            log.warning("dropped a malformed cancel: %s", e)
            return
        if not REQUEST_ID.match(m.request_id) or not m.tenant:
            log.warning("dropped a cancel with no usable request id or tenant: %r", m.request_id[:100])
            return
        await self.post(Cancel(m.request_id, m.tenant, m.reason))

    def forget(self, request_id: str) -> None:
        """A cancel was carried out: its poll entry (if any) goes with the next poll."""
        self._done.add(request_id)

    async def poll_loop(self) -> None:
        key = self.keys.cancels
        last_trim = 0.0
        while True:
            await asyncio.sleep(POLL_S)
            if not self.leading():
                continue
            wall = time.time()
            try:
                if self._done:
                    done, self._done = self._done, set()
                    await self.redis.zrem(key, *done)
                for raw in await self.redis.zrangebyscore(key, wall - KEEP_S, "+inf"):
                    await self.post(Cancel(raw.decode(errors="replace"), None))
                if wall - last_trim >= KEEP_S / 4:
                    last_trim = wall
                    await self.redis.zremrangebyscore(key, "-inf", wall - KEEP_S)
            except Exception as e:  # noqa: BLE001 - Redis away: polled again next period
                log.warning("polling the cancels failed: %s: %s", type(e).__name__, e)

    # -- views ------------------------------------------------------------------------------------
    def _busy(self, what: str) -> bool:
        """Whether the last write of ``what`` is still under way (the next one is then skipped)."""
        running = self._writing.get(what)
        return running is not None and not running.done()

    def _start(self, what: str, write: Coroutine) -> None:
        self._writing[what] = asyncio.create_task(write)

    def write_views(self, e: WriteViews) -> None:
        self.metrics.tenants(e.tenants, e.backlog)
        if e.stats is not None:
            log.info("state: %s", e.stats)
            for tenant, v in sorted(e.tenants.items()):
                log.info("tenant %s: %s", tenant, " ".join(f"{k}={v[k]}" for k in sorted(v)))
        if not self._busy("views"):
            self._start("views", self._write_views(e))

    async def _write_views(self, e: WriteViews) -> None:
        if e.tenants:
            try:
                mapping = {t: msgspec.json.encode(v) for t, v in e.tenants.items()}
                await self.redis.hset(self.keys.tenants, mapping=mapping)
            except Exception as ex:  # noqa: BLE001 - the view is refreshed next second
                log.warning("writing the tenant view failed: %s", ex)
        key = self.keys.executors_view
        view = e.executors
        gone = (self._written or set()) - set(view)
        try:
            pipe = self.redis.pipeline(transaction=False)
            if self._written is None:
                pipe.delete(key)  # what an earlier leader wrote
            if gone:
                pipe.hdel(key, *gone)
            if view:
                pipe.hset(key, mapping={k: msgspec.json.encode(v) for k, v in view.items()})
            if self._written is None or gone or view:
                await pipe.execute()
        except Exception as ex:  # noqa: BLE001 - written again next period
            log.warning("writing the executors view failed: %s: %s", type(ex).__name__, ex)
            self._written = None
            return
        self._written = set(view)

    def write_backlog(self, counts: dict[str, int], now: float) -> None:
        """Write the backlog's counts when they changed since the last write, or every ``view_s``
        anyway (to renew the key's TTL). A tenant whose count fell to zero is written as 0 once
        (HDEL is not among the scheduler's Redis commands); the first write replaces whatever an
        earlier scheduler left."""
        if (counts == self._backlog and now - self._backlog_at < self.view_s) or self._busy("backlog"):
            return
        self._backlog_at = now
        self._start("backlog", self._write_backlog(counts))

    async def _write_backlog(self, counts: dict[str, int]) -> None:
        key = self.keys.backlog
        mapping = {t: 0 for t in self._backlog or {}} | counts
        try:
            pipe = self.redis.pipeline(transaction=False)
            if self._backlog is None:
                pipe.delete(key)
            if mapping:
                pipe.hset(key, mapping=mapping)
                pipe.expire(key, max(5, int(10 * self.view_s)))
            await pipe.execute()
        except Exception as e:  # noqa: BLE001 - the counts are written again next tick
            if not self._backlog_failed:
                log.warning("writing the backlog counts failed: %s: %s", type(e).__name__, e)
            self._backlog_failed = True
            return
        self._backlog_failed = False
        self._backlog = counts

    def stop(self) -> None:
        for t in self._writing.values():
            t.cancel()
