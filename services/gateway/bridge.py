"""The gateway's side of the bus: submit image requests, wait for results, fetch the PNGs.

Requests go onto the JetStream intake (deduplicated by ``Nats-Msg-Id``, so a retried publish is
not a second request). Results come back on ``{ns}.results.<id>``; one wildcard subscription routes
them to waiting calls. Should a result message be missed (core NATS is at-most-once), the request
state in Redis has it too, and the waiter checks there every few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import ObjectNotFoundError
from nats.js.object_store import ObjectStore
from redis.asyncio import Redis

from libs.common.jetstream import ensure_images_bucket, ensure_intake_stream
from libs.common.registry_client import RegistryClient
from libs.common.retry import retry
from libs.protocol.keys import Keys
from libs.protocol.messages import ImageRef, ImageRequest, RequestResult, encode, result_decoder
from libs.protocol.subjects import Subjects

log = logging.getLogger(__name__)

FALLBACK_POLL_S = 3.0


class Bridge:
    def __init__(self, nc: Client, redis: Redis, subjects: Subjects, keys: Keys) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.redis = redis
        self.subjects = subjects
        self.keys = keys
        self.registry = RegistryClient(nc, subjects)
        self.images: ObjectStore | None = None
        self._waiters: dict[str, asyncio.Future[RequestResult]] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        await ensure_intake_stream(self.js, self.subjects)
        self.images = await ensure_images_bucket(self.js, self.subjects)
        self._sub = await self.nc.subscribe(self.subjects.result("*"), cb=self._on_result)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be closed already
                pass
            self._sub = None
        for fut in self._waiters.values():
            fut.cancel()

    async def _on_result(self, msg: Msg) -> None:
        try:
            result = result_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            log.warning("dropped a malformed result: %s", e)
            return
        fut = self._waiters.get(result.request_id)
        if fut is not None and not fut.done():
            fut.set_result(result)

    def expect(self, request_id: str) -> asyncio.Future[RequestResult]:
        """Register interest in a result *before* submitting, so it cannot be missed."""
        fut: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        return fut

    def forget(self, request_id: str) -> None:
        fut = self._waiters.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def submit(self, req: ImageRequest) -> None:
        await self.redis.hset(
            self.keys.request(req.request_id),
            mapping={
                "status": "submitted",
                "tenant": req.tenant,
                "workflow": req.workflow,
                "submitted_at": time.time(),
            },
        )
        await self.redis.expire(self.keys.request(req.request_id), 86400)
        payload = encode(req)
        await retry(
            lambda: self.js.publish(self.subjects.intake, payload, headers={"Nats-Msg-Id": req.request_id}),
            f"publishing {req.request_id}",
        )

    async def wait(
        self, request_id: str, fut: asyncio.Future[RequestResult], wait_s: float
    ) -> RequestResult | None:
        """The result, or None after ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), min(left, FALLBACK_POLL_S))
                except TimeoutError:
                    stored = await self.redis.hget(self.keys.request(request_id), "result")
                    if stored:
                        return result_decoder.decode(stored)
        finally:
            self.forget(request_id)

    async def fetch_image(self, ref: ImageRef, delete: bool) -> bytes | None:
        assert self.images is not None
        images = self.images
        try:
            res = await retry(lambda: images.get(ref.name), f"reading {ref.name}")
        except ObjectNotFoundError:
            return None
        if delete:
            try:
                await self.images.delete(ref.name)
            except Exception as e:  # noqa: BLE001 - the bucket's TTL removes it anyway
                log.debug("could not delete %s: %s", ref.name, e)
        return res.data

    async def tenant_view(self) -> dict[str, dict]:
        """Per-tenant counters (Redis, written atomically by the scheduler) and its operator view."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.vtime)
        pipe.hgetall(self.keys.service)
        pipe.hgetall(self.keys.ops)
        pipe.hgetall(self.keys.tenants)
        vtime, service, ops, view = await pipe.execute()
        out: dict[str, dict] = {}
        for raw_tenant, raw in view.items():
            try:
                out[raw_tenant.decode()] = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                continue
        for key, table, conv in (("vtime_s", vtime, float), ("service_s", service, float), ("ops", ops, int)):
            for raw_tenant, raw in table.items():
                out.setdefault(raw_tenant.decode(), {})[key] = conv(raw)
        return out

    async def put_image(self, name: str, data: bytes) -> None:
        images = self.images
        assert images is not None
        await retry(lambda: images.put(name, data), f"storing {name}")

    async def request_tenant(self, request_id: str) -> str | None:
        t = await self.redis.hget(self.keys.request(request_id), "tenant")
        return t.decode() if t else None
