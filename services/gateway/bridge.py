"""The gateway's side of the bus: submit image requests, wait for results, fetch the PNGs.

Requests go onto the JetStream intake (deduplicated by ``Nats-Msg-Id``, so a retried publish is
not a second request). Results come back on ``{ns}.results.<id>``; one wildcard subscription routes
them to waiting calls (several may wait for one request: the call that made it and retries with
its idempotency key). Should a result message be missed (core NATS is at-most-once), the request
state in Redis has it too, and the waiter checks there every few seconds.

A result is accepted only for a request some call here waits for, and only after
``results.result_problem`` found nothing wrong with it (it names that request, and only that
request's own image objects); anything else is logged and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import ObjectNotFoundError
from nats.js.object_store import ObjectStore
from redis.asyncio import Redis
from redis.exceptions import RedisError

from libs.common.jetstream import ensure_images_bucket, ensure_intake_stream
from libs.common.registry_client import RegistryClient
from libs.common.retry import retry
from libs.protocol.keys import Keys
from libs.protocol.messages import (
    CancelRequest,
    ImageRef,
    ImageRequest,
    RequestResult,
    encode,
    result_decoder,
)
from libs.protocol.subjects import Subjects
from services.gateway.records import RESULT_TTL_S
from services.gateway.results import STATUS, ImageState, decode_checked, result_problem

log = logging.getLogger(__name__)

FALLBACK_POLL_S = 3.0
STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
ENDED = (b"succeeded", b"failed", b"cancelled")  # a request's final states in ``{ns}:req:{id}``
CANCELS_TTL_S = 86400  # the cancels set's TTL, renewed by every cancel (the scheduler trims it)


class Bridge:
    def __init__(self, nc: Client, redis: Redis, subjects: Subjects, keys: Keys) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.redis = redis
        self.subjects = subjects
        self.keys = keys
        self.registry = RegistryClient(nc, subjects)
        self.images: ObjectStore | None = None
        self._waiters: dict[str, set[asyncio.Future[RequestResult]]] = {}
        self._sub: Subscription | None = None
        self._result_prefix = subjects.result("")

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
        for futs in self._waiters.values():
            for fut in futs:
                fut.cancel()

    @property
    def bucket(self) -> str:
        return self.subjects.images_bucket

    async def _on_result(self, msg: Msg) -> None:
        rid = msg.subject[len(self._result_prefix) :]
        futs = self._waiters.get(rid)
        if not futs:
            # Normal with several gateway replicas (each sees every result), or after a call gave up.
            log.debug("ignored a result on %s: no call here waits for it", msg.subject)
            return
        try:
            result = result_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            log.warning("dropped a malformed result on %s: %s", msg.subject, e)
            return
        problem = result_problem(rid, result, self.bucket)
        if problem is not None:
            log.warning(
                "dropped a result on %s that does not answer request %s: %s", msg.subject, rid, problem
            )
            return
        for fut in futs:
            if not fut.done():
                fut.set_result(result)

    def expect(self, request_id: str) -> asyncio.Future[RequestResult]:
        """Register interest in a result *before* submitting (or looking), so it cannot be missed."""
        fut: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(request_id, set()).add(fut)
        return fut

    def forget(self, request_id: str, fut: asyncio.Future[RequestResult]) -> None:
        futs = self._waiters.get(request_id)
        if futs is not None:
            futs.discard(fut)
            if not futs:
                del self._waiters[request_id]
        if not fut.done():
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
        self, request_id: str, wait_s: float, fut: asyncio.Future[RequestResult] | None = None
    ) -> RequestResult | None:
        """The request's (checked) result, or None after ``wait_s`` seconds.

        ``fut`` is from :meth:`expect`, called before the request was submitted (else here). Looks
        in Redis first, so a request that ended before this call began is answered at once.
        """
        if fut is None:
            fut = self.expect(request_id)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    stored = await self.stored_result(request_id)
                except RedisError as e:  # Redis away: the result still comes over NATS
                    log.warning("looking up the result of %s failed: %s; waiting on the bus", request_id, e)
                    stored = None
                if stored is not None:
                    return stored
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), min(left, FALLBACK_POLL_S))
                except TimeoutError:
                    continue
        finally:
            self.forget(request_id, fut)

    async def remember(self, results: list[RequestResult]) -> None:
        """Keep the results a call answers with (checked already), so a lookup sees them at once."""
        if not results:
            return
        pipe = self.redis.pipeline(transaction=False)
        for r in results:
            pipe.set(self.keys.result(r.request_id), encode(r), ex=RESULT_TTL_S)
        try:
            await pipe.execute()
        except RedisError as e:  # the call is answered anyway; a lookup by id finds the scheduler's copy
            log.warning("keeping the results of a call failed: %s", e)

    async def stored_result(self, request_id: str) -> RequestResult | None:
        """The result kept by the gateway, else by the scheduler (``{ns}:req:{id}``), checked."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.result(request_id))
        pipe.hget(self.keys.request(request_id), "result")
        for raw in await pipe.execute():
            if not raw:
                continue
            result, problem = decode_checked(request_id, raw, self.bucket)
            if result is not None:
                return result
            log.warning("ignored a stored result of %s: %s", request_id, problem)
        return None

    async def states(self, request_ids: list[str]) -> list[ImageState]:
        """Each request's state from Redis (a request not there yet counts as queued)."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.get(self.keys.result(rid))
            pipe.hmget(self.keys.request(rid), "status", "result")
        replies = await pipe.execute()
        out = []
        for i, rid in enumerate(request_ids):
            own, (status, raw) = replies[2 * i], replies[2 * i + 1]
            if own or raw:
                result, problem = decode_checked(rid, own or raw, self.bucket)
                if result is None:
                    log.warning("the stored result of %s is unusable: %s", rid, problem)
                    result = RequestResult(
                        rid, "failed", error="the result was refused", error_code="internal"
                    )
                out.append(ImageState(result.status, result))
            else:
                # Ended in the scheduler, its result not stored yet (the state is written as the
                # request ends, the result once its charges are: services/scheduler/shell/service.py,
                # _finish): still finishing, as far as a caller can tell.
                raw_status = status or b""
                now = (
                    "running"
                    if raw_status in ENDED
                    else STATUS.get(raw_status.decode(errors="replace"), "queued")
                )
                out.append(ImageState(now))
        return out

    async def progress(self, request_ids: list[str]) -> dict[str, int]:
        """Nodes done and denoising steps finished over these requests (the scheduler keeps them in
        each request's hash)."""
        names = ("nodes_done", "nodes_total", "step", "steps")
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.hmget(self.keys.request(rid), *names)
        total = dict.fromkeys(names, 0)
        for values in await pipe.execute():
            for name, raw in zip(names, values, strict=True):
                try:
                    total[name] += int(float(raw)) if raw else 0
                except ValueError:
                    continue
        return total

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

    async def cancel(self, request_id: str, tenant: str, reason: str = "") -> bool:
        """Ask the scheduler to cancel an image request of ``tenant`` (checked by the caller too);
        False when there is nothing to cancel: the request is unknown, another tenant's, or ended.

        The request is flagged in Redis first (``cancel`` in its hash, and ``{ns}:cancels``), then
        the leading scheduler is told on ``{ns}.sched.cancel``: the message makes it immediate, the
        flags make it survive a lost message or a scheduler fail-over (``services/scheduler/shell/control.py``).
        The request's ``cancelled`` result comes back like any other (:meth:`wait`)."""
        key = self.keys.request(request_id)
        status, owner = await self.redis.hmget(key, "status", "tenant")
        if owner is None or owner.decode(errors="replace") != tenant or (status or b"") in ENDED:
            return False
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping={"cancel": now} | ({"cancel_reason": reason[:200]} if reason else {}))
        pipe.zadd(self.keys.cancels, {request_id: now})
        pipe.expire(self.keys.cancels, CANCELS_TTL_S)
        await pipe.execute()
        try:
            await self.nc.publish(self.subjects.cancels, encode(CancelRequest(request_id, tenant, reason)))
        except Exception as e:  # noqa: BLE001 - the scheduler polls the flags within a second
            log.warning("telling the scheduler to cancel %s failed: %s; it finds the flag", request_id, e)
        return True

    async def events(
        self, request_id: str, last_id: str = "0-0", block_ms: int = 15000, count: int = 100
    ) -> list[tuple[str, dict]]:
        """The request's progress events after ``last_id`` (a stream entry id; ``"0-0"``: from the
        start), waiting up to ``block_ms`` for one (0: do not wait): ``[(entry id, event), ...]``,
        empty when none came. Events are the scheduler's (``services/scheduler/core/progress.py``):
        ``{"type": "node", ...}`` per finished node, and a last ``{"type": "end", ...}``."""
        if not STREAM_ID.match(last_id):
            raise ValueError(f"last_id must be a stream entry id like 1733000000000-0, not {last_id!r}")
        out = []
        for _rid, eid, event in await self.read_events({request_id: last_id}, block_ms, count):
            if event is None:
                log.warning("skipped a malformed event %s of %s", eid, request_id)
            else:
                out.append((eid, event))
        return out

    async def read_events(
        self, after: dict[str, str], block_ms: int, count: int
    ) -> list[tuple[str, str, dict | None]]:
        """One read of several requests' progress streams, each after its entry id:
        ``[(request id, entry id, event or None when malformed), ...]`` in stream order."""
        keys = {self.keys.events(rid): rid for rid in after}
        streams = {key: after[rid] for key, rid in keys.items()}
        reply = await self.redis.xread(streams, count=count, block=block_ms or None)
        out: list[tuple[str, str, dict | None]] = []
        for raw_key, entries in reply or []:
            rid = keys[raw_key.decode() if isinstance(raw_key, bytes) else raw_key]
            for entry_id, fields in entries:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                try:
                    event = msgspec.json.decode(fields.get(b"data") or b"")
                except msgspec.DecodeError:
                    event = None
                out.append((rid, eid, event if isinstance(event, dict) else None))
        return out
