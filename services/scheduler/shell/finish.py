"""How a request ends, carried out: publish the result, make the end durable, then ack.

This is the one handler of the ``Finished`` effect (and of the answers the take-in gives itself,
``intake.py``). The order is told once, in docs/scheduling.md ("The result"): the result is
published at once (a Redis outage must not hold the answer up); then the request's end is made
durable — the effects queued before it carried out (``flushed``), the result and the progress
stream's last entry stored in Redis, retried — with the intake message kept alive meanwhile
(:attr:`Finisher.finishing`, read by the shell's keep-alive loop); only then is the message acked.
A scheduler that dies before the ack leaves the message to the next one, which finds the result in
Redis (or, if it was never stored, runs the request again): never answered but unrecorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from redis.asyncio import Redis

from libs.common.logs import bind_request
from libs.common.metrics import SchedulerMetrics
from libs.protocol.keys import Keys
from libs.protocol.messages import RequestResult, encode
from libs.protocol.subjects import Subjects
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.progress import end_event
from services.scheduler.shell.outbox import EVENTS_MAXLEN, EVENTS_TTL_S
from services.scheduler.shell.retrying import Backoff, retry_transient

log = logging.getLogger(__name__)


class Finisher:
    def __init__(
        self,
        *,
        nc: Client,
        redis: Redis,
        subjects: Subjects,
        keys: Keys,
        cfg: SchedulerConfig,
        metrics: SchedulerMetrics,
        leading: Callable[[], bool],
    ) -> None:
        self.nc = nc
        self.redis = redis
        self.subjects = subjects
        self.keys = keys
        self.cfg = cfg
        self.metrics = metrics
        self.leading = leading
        self.tasks: set[asyncio.Task] = set()  # results being published, stored and acked
        self.finishing: dict[str, Msg] = {}  # their intake messages, kept alive until acked

    def finish_soon(
        self, result: RequestResult, tenant: str, m: Msg | None, flushed: asyncio.Event | None = None
    ) -> None:
        t = asyncio.create_task(self.finish(result, tenant, m, flushed))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def finish(
        self, result: RequestResult, tenant: str, m: Msg | None, flushed: asyncio.Event | None = None
    ) -> None:
        rid = result.request_id
        bind_request(rid)  # this task's log lines (the result's among them) carry the request id
        self.metrics.finished(result, tenant)
        data = encode(result)
        try:
            await self.nc.publish(self.subjects.result(rid), data)
        except Exception as ex:  # noqa: BLE001 - the gateway also polls Redis for it
            log.warning("publishing the result of %s failed: %s; it goes to Redis", rid, ex)
        if m is not None:
            self.finishing[rid] = m  # kept alive, as while it was taken in or ran
        try:
            if flushed is not None:
                await flushed.wait()
            await self._store(result, tenant, data)
        finally:
            self.finishing.pop(rid, None)
        if m is not None and self.leading():
            try:
                await retry_transient(m.ack, f"acking {rid}", backoff=self._backoff(), give_up_after_s=10.0)
            except Exception as ex:  # noqa: BLE001 - a redelivery finds the result in Redis
                log.warning("ack of %s failed: %s", rid, ex)

    async def _store(self, result: RequestResult, tenant: str, data: bytes) -> None:
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

    async def stop(self) -> None:
        """Give results being sent a moment to go out and be acked (then only their Redis copy is
        cut short)."""
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=2.0)
        for t in list(self.tasks):
            t.cancel()
