"""What the gateway itself keeps in Redis: one record per generation call, and idempotency keys.

The scheduler keeps each *image* request's state and result (``{ns}:req:{request_id}``, 24 h). A
generation call (``n`` images, one response) exists only at the gateway, so the gateway records
what it needs to answer for the call again — who made it, how it was asked for, which image
requests belong to it — so that ``GET /v1/requests/{id}`` and a retry with the same
``Idempotency-Key`` give the same answer the original call gave, even when the original connection
is gone.

| key | type | holds |
|---|---|---|
| ``{ns}:gw:gen:{generation_id}`` | string | JSON :class:`GenerationRecord` (24 h) |
| ``{ns}:gw:idem:{tenant}:{sha256(key)}`` | string | JSON :class:`IdempotencyRecord` (24 h) |
| ``{ns}:gw:res:{request_id}`` | string | the checked ``RequestResult`` the gateway answered with (1 h) |
| ``{ns}:gw:recent:{tenant}`` | sorted set | a tenant's calls (id scored by the time it was recorded), newest 1000, 24 h |
| ``{ns}:gw:recent`` | sorted set | every tenant's calls, newest 5000, 24 h (``GET /v1/requests?tenant=*``) |

The last is written before a call answers, so a lookup right after the answer sees it: the
scheduler publishes a result before its own copy lands in ``{ns}:req:{id}``.

(These belong in ``libs/protocol/keys.py``'s table; they live here while only the gateway reads
them. Both hang off the namespace, so ``Keys.pattern()`` covers them.)
"""

from __future__ import annotations

import hashlib
import time

import msgspec
from redis.asyncio import Redis

from libs.protocol.ids import image_request_id
from libs.protocol.keys import Keys

RECORD_TTL_S = 86400  # as long as the scheduler keeps the requests' state
IDEMPOTENCY_TTL_S = 86400
RESULT_TTL_S = 3600  # as long as the images are kept; the scheduler's copy lasts 24 h
RECENT_PER_TENANT = 1000  # calls listed by GET /v1/requests, per tenant
RECENT_ALL = 5000  # and over all tenants (admins)


class GenerationRecord(msgspec.Struct, omit_defaults=True):
    """One ``POST /v1/images/generations`` call as the gateway accepted it."""

    id: str
    tenant: str
    model: str
    created: int  # unix seconds: the ``created`` of every answer for this call
    n: int
    response_format: str
    seeds: list[int | None]
    timeout_s: float
    # Resolved LoRA path -> LoRA name, so error text from executors is shown with names only.
    loras: dict[str, str] = {}
    # How its images are handed out (``formats.py``): kept so a lookup or replay encodes alike.
    output_format: str = "png"
    output_compression: int = 100
    size: str | None = None

    @property
    def request_ids(self) -> list[str]:
        return request_ids(self.id, self.n)


class IdempotencyRecord(msgspec.Struct):
    generation_id: str
    fingerprint: str  # sha256 of the body, canonical (sorted keys)


def request_ids(generation_id: str, n: int) -> list[str]:
    """The image request ids of a generation call (``{generation_id}-{i}``)."""
    return [image_request_id(generation_id, i) for i in range(n)]


def fingerprint(body: object) -> str:
    return hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()


class Records:
    def __init__(self, redis: Redis, ns: str) -> None:
        self.redis = redis
        self.keys = Keys(ns)

    async def save(self, rec: GenerationRecord) -> None:
        """Keep the call, and list it among its tenant's (and everyone's) recent calls."""
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.generation(rec.id), msgspec.json.encode(rec), ex=RECORD_TTL_S)
        for key, bound in (
            (self.keys.recent(rec.tenant), RECENT_PER_TENANT),
            (self.keys.recent(None), RECENT_ALL),
        ):
            pipe.zadd(key, {rec.id: now})  # not ``created``: whole seconds would tie
            pipe.zremrangebyscore(key, "-inf", now - RECORD_TTL_S)  # their records are gone
            pipe.zremrangebyrank(key, 0, -bound - 1)
            pipe.expire(key, RECORD_TTL_S)
        await pipe.execute()

    async def recent(self, tenant: str | None, limit: int) -> list[GenerationRecord]:
        """Up to ``limit`` recent calls of ``tenant`` (every tenant's for None), newest first."""
        ids = await self.redis.zrevrange(self.keys.recent(tenant), 0, limit - 1)
        if not ids:
            return []
        raws = await self.redis.mget([self.keys.generation(i.decode()) for i in ids])
        out = []
        for raw in raws:
            if raw is None:  # expired, or dropped (its submission failed)
                continue
            try:
                out.append(msgspec.json.decode(raw, type=GenerationRecord))
            except msgspec.DecodeError:
                continue
        return out

    async def load(self, generation_id: str) -> GenerationRecord | None:
        if not generation_id or len(generation_id) > 64:
            return None
        raw = await self.redis.get(self.keys.generation(generation_id))
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=GenerationRecord)
        except msgspec.DecodeError:
            return None

    async def drop(self, generation_id: str, tenant: str | None = None) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.generation(generation_id))
        if tenant is not None:
            pipe.zrem(self.keys.recent(tenant), generation_id)
            pipe.zrem(self.keys.recent(None), generation_id)
        await pipe.execute()

    async def claim(self, tenant: str, key: str, rec: IdempotencyRecord) -> IdempotencyRecord | None:
        """Claim ``key`` for ``rec``: None when it is ours now, else the record that holds it."""
        rkey = self.keys.idempotency(tenant, key)
        data = msgspec.json.encode(rec)
        for _ in range(3):  # the holder may expire between SET NX and GET
            if await self.redis.set(rkey, data, nx=True, ex=IDEMPOTENCY_TTL_S):
                return None
            held = await self.held(tenant, key)
            if held is not None:
                return held
        await self.redis.set(rkey, data, ex=IDEMPOTENCY_TTL_S)  # an unreadable record: replace it
        return None

    async def held(self, tenant: str, key: str) -> IdempotencyRecord | None:
        raw = await self.redis.get(self.keys.idempotency(tenant, key))
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=IdempotencyRecord)
        except msgspec.DecodeError:
            return None

    async def release(self, tenant: str, key: str, rec: IdempotencyRecord) -> None:
        """Give a claimed key back (nothing was submitted under it), if it is still ours."""
        rkey = self.keys.idempotency(tenant, key)
        if await self.redis.get(rkey) == msgspec.json.encode(rec):
            await self.redis.delete(rkey)
