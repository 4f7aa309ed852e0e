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

A request in the core is cancelled there (``SchedulerCore.cancel``: its running nodes are
cancelled and refunded, it ends ``cancelled``); one queued for admission is answered from the
backlog. Cancelling an ended or unknown request does nothing. The message's tenant must be the
request's (a poll entry, written by the gateway after its own tenant check, is trusted).

*Executors view.* Every ``view_s`` the leader writes ``{ns}:executors`` (executor id -> JSON,
``views.executors_view``) for ``GET /v1/admin/executors``, the CLI's ``top`` and the console; an
executor that left is removed from it. A new leader replaces the whole hash on its first write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec
from nats.aio.msg import Msg

from libs.common.service import run_all
from libs.protocol.messages import cancel_decoder
from services.scheduler.intake import REQUEST_ID
from services.scheduler.views import BusyMeter, executors_view

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often ``{ns}:cancels`` is read (a cancel whose message was lost waits this long)
KEEP_S = 120.0  # entries older than this are trimmed from ``{ns}:cancels``


class Control:
    def __init__(self, svc: SchedulerService) -> None:
        self.svc = svc
        self.busy = BusyMeter()
        self._written: set[str] | None = None  # executor ids in ``{ns}:executors`` (None: never)
        self.cancelled = 0  # requests this scheduler answered ``cancelled``

    async def run(self) -> None:
        await run_all(self._poll_loop(), self._view_loop())

    # -- cancel -----------------------------------------------------------------------------------
    async def on_message(self, msg: Msg) -> None:
        """A ``CancelRequest`` from the gateway (validated; a bad one is logged and dropped)."""
        if not self.svc.leading:
            return
        try:
            m = cancel_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            log.warning("dropped a malformed cancel: %s", e)
            return
        if not REQUEST_ID.match(m.request_id) or not m.tenant:
            log.warning("dropped a cancel with no usable request id or tenant: %r", m.request_id[:100])
            return
        self.cancel(m.request_id, m.tenant, m.reason)

    def cancel(self, request_id: str, tenant: str | None, reason: str = "") -> bool:
        """Cancel a request this leader holds (``tenant`` None: trusted, the request's own); False
        when it holds none of that id and tenant (ended, not taken in yet, or another's)."""
        svc = self.svc
        if not svc.leading:
            return False
        run = svc.core.runs.get(request_id)
        queued = None if run is not None else next(
            (q for q in svc.intake.backlog if q.req.request_id == request_id), None
        )  # fmt: skip
        owner = run.req.tenant if run is not None else queued.req.tenant if queued is not None else None
        if owner is None or (tenant is not None and tenant != owner):
            if owner is not None:
                log.warning("ignored a cancel of %s for tenant %r: it is %r's", request_id, tenant, owner)
            return False
        try:
            if run is not None:
                svc._apply(svc.core.cancel(request_id, owner, reason))  # noqa: SLF001 - the scheduler shell's state spread over several objects (issue 21, item 1)
                svc._schedule_soon()  # its executors are free (or soon): others' work goes there  # noqa: SLF001 - the scheduler shell's state spread over several objects (issue 21, item 1)
                done = True
            else:
                done = svc.intake.cancel(request_id, owner, reason)
        except Exception:
            log.exception("cancelling %s failed", request_id)
            return False
        self.cancelled += int(done)
        return done

    async def _poll_loop(self) -> None:
        key = self.svc.keys.cancels
        last_trim = 0.0
        while True:
            await asyncio.sleep(POLL_S)
            if not self.svc.leading:
                continue
            wall = time.time()
            try:
                raw = await self.svc.redis.zrangebyscore(key, wall - KEEP_S, "+inf")
                done = [rid for rid in (r.decode(errors="replace") for r in raw) if self.cancel(rid, None)]
                if done:
                    await self.svc.redis.zrem(key, *done)
                if wall - last_trim >= KEEP_S / 4:
                    last_trim = wall
                    await self.svc.redis.zremrangebyscore(key, "-inf", wall - KEEP_S)
            except Exception as e:  # noqa: BLE001 - Redis away: polled again next period
                log.warning("polling the cancels failed: %s: %s", type(e).__name__, e)

    # -- executors view ---------------------------------------------------------------------------
    async def _view_loop(self) -> None:
        cfg = self.svc.cfg
        last = 0.0
        while True:
            await asyncio.sleep(cfg.tick_s)
            now = time.monotonic()
            self.busy.sample(self.svc.core.executors, now)
            if now - last >= cfg.view_s and self.svc.leading:
                last = now
                await self._publish(now)

    async def _publish(self, now: float) -> None:
        view = executors_view(self.svc.core.executors, self.busy.busy, now, time.time())
        key = self.svc.keys.executors_view
        gone = (self._written or set()) - set(view)
        try:
            pipe = self.svc.redis.pipeline(transaction=False)
            if self._written is None:
                pipe.delete(key)  # what an earlier leader wrote
            if gone:
                pipe.hdel(key, *gone)
            if view:
                pipe.hset(key, mapping={k: msgspec.json.encode(v) for k, v in view.items()})
            if self._written is None or gone or view:
                await pipe.execute()
        except Exception as e:  # noqa: BLE001 - written again next period
            log.warning("writing the executors view failed: %s: %s", type(e).__name__, e)
            self._written = None
            return
        self._written = set(view)
