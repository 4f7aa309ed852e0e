"""Versioned workflow specs in Redis.

Versions are immutable: registering a spec that differs from the latest version stores it as
latest + 1; registering the same spec again returns the existing version (idempotent clients).
Both happen in one Lua script, so concurrent registrations never assign a version twice.
"""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis

from libs.protocol.adverts import StoredAdvert, adverts_key, stored_decoder
from libs.protocol.keys import Keys
from libs.protocol.messages import LoraInfo, WorkflowSummary
from libs.workflow.capabilities import summary
from libs.workflow.spec import WorkflowSpec, decode_spec

# KEYS[1] = index hash (name -> latest), KEYS[2] = the workflow's hash (version -> spec JSON)
# ARGV[1] = name, ARGV[2] = canonical spec JSON (version 0). Returns {version, created}.
_PUT = """
local latest = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if latest > 0 and redis.call('HGET', KEYS[2], tostring(latest)) == ARGV[2] then
  return {latest, 0}
end
local v = latest + 1
redis.call('HSET', KEYS[2], tostring(v), ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], tostring(v))
return {v, 1}
"""


class WorkflowStore:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._put = redis.register_script(_PUT)

    async def put(self, spec: WorkflowSpec) -> tuple[WorkflowSpec, bool]:
        canonical = msgspec.json.encode(msgspec.structs.replace(spec, version=0), order="deterministic")
        version, created = await self._put(
            keys=[self.keys.workflow_index, self.keys.workflow(spec.name)], args=[spec.name, canonical]
        )
        return msgspec.structs.replace(spec, version=int(version)), bool(created)

    async def get(self, name: str, version: int = 0) -> WorkflowSpec | None:
        if version <= 0:
            latest = await self.redis.hget(self.keys.workflow_index, name)
            if latest is None:
                return None
            version = int(latest)
        raw = await self.redis.hget(self.keys.workflow(name), str(version))
        if raw is None:
            return None
        return msgspec.structs.replace(decode_spec(raw), version=version)

    async def list(self) -> list[WorkflowSummary]:
        index = await self.redis.hgetall(self.keys.workflow_index)
        out = []
        for name_b, version_b in sorted(index.items()):
            spec = await self.get(name_b.decode(), int(version_b))
            if spec is not None:
                out.append(summary(spec))
        return out


class LoraStore:
    """Registered LoRA adapters (name -> safetensors path). Re-registering a name replaces it."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def put(self, lora: LoraInfo) -> bool:
        """Store ``lora``; True when the name is new."""
        return bool(await self.redis.hset(self.keys.loras, lora.name, msgspec.json.encode(lora)))

    async def get(self, name: str) -> LoraInfo | None:
        raw = await self.redis.hget(self.keys.loras, name)
        return msgspec.json.decode(raw, type=LoraInfo) if raw else None

    async def list(self) -> list[LoraInfo]:
        raw = await self.redis.hgetall(self.keys.loras)
        return sorted((msgspec.json.decode(v, type=LoraInfo) for v in raw.values()), key=lambda x: x.name)


class AdvertStore:
    """The ModelFns executors advertise (libs/protocol/adverts.py), one hash field per executor
    with its signatures and an expiry; shared by every registry replica through Redis."""

    def __init__(self, redis: Redis, ns: str) -> None:
        self.redis = redis
        self.key = adverts_key(ns)

    async def put(self, executor: str, signatures: dict[str, msgspec.Raw], ttl_s: float) -> None:
        stored = StoredAdvert(signatures=signatures, expires=time.time() + ttl_s)
        await self.redis.hset(self.key, executor, msgspec.json.encode(stored))

    async def live(self) -> dict[str, StoredAdvert]:
        """Executor -> its advertisement, for every one not expired (the expired ones are deleted
        on the way)."""
        now = time.time()
        out: dict[str, StoredAdvert] = {}
        stale = []
        for executor_b, raw in (await self.redis.hgetall(self.key)).items():
            try:
                stored = stored_decoder.decode(raw)
            except msgspec.DecodeError:
                stale.append(executor_b)
                continue
            if stored.expires < now:
                stale.append(executor_b)
            else:
                out[executor_b.decode()] = stored
        if stale:
            await self.redis.hdel(self.key, *stale)
        return out
