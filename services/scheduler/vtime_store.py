"""Tenant counters in Redis, updated atomically by one Lua script per change (paper §6).

A scheduler restart reads them back (:meth:`VTimeStore.load`), so vTime survives it. Redis converts
a Lua number in a script's reply to an integer (truncating it), so the script formats floats with
``%.17g`` (round-trip exact) and returns strings.
"""

from __future__ import annotations

from redis.asyncio import Redis

from libs.protocol.keys import Keys
from services.scheduler.effects import ChargeVTime

# KEYS: vtime, ops, service hashes. ARGV: tenant, delta, set vtime|'', ops delta, op floor|'', service delta.
_CHARGE = """
local t = ARGV[1]
local v = tonumber(redis.call('HGET', KEYS[1], t) or '0')
if ARGV[3] ~= '' then v = tonumber(ARGV[3]) end
v = v + tonumber(ARGV[2])
local vs = string.format('%.17g', v)
redis.call('HSET', KEYS[1], t, vs)
local o = tonumber(redis.call('HGET', KEYS[2], t) or '0')
if ARGV[5] ~= '' then o = math.max(o, tonumber(ARGV[5])) end
o = o + tonumber(ARGV[4])
local os = string.format('%d', o)
redis.call('HSET', KEYS[2], t, os)
local s = tonumber(redis.call('HGET', KEYS[3], t) or '0') + tonumber(ARGV[6])
local ss = string.format('%.17g', s)
redis.call('HSET', KEYS[3], t, ss)
return {vs, os, ss}
"""


class VTimeStore:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._charge = redis.register_script(_CHARGE)

    async def apply(self, c: ChargeVTime) -> tuple[float, int, float]:
        """Apply one change; returns the tenant's (vtime, ops, service) after it."""
        v, o, s = await self._charge(
            keys=[self.keys.vtime, self.keys.ops, self.keys.service],
            args=[
                c.tenant,
                repr(float(c.delta)),
                "" if c.set_vtime is None else repr(float(c.set_vtime)),
                str(int(c.ops)),
                "" if c.op_floor is None else str(int(c.op_floor)),
                repr(float(c.service_s)),
            ],
        )
        return float(v), int(o), float(s)

    async def load(self) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
        vt = await self.redis.hgetall(self.keys.vtime)
        ops = await self.redis.hgetall(self.keys.ops)
        svc = await self.redis.hgetall(self.keys.service)
        return (
            {k.decode(): float(v) for k, v in vt.items()},
            {k.decode(): int(v) for k, v in ops.items()},
            {k.decode(): float(v) for k, v in svc.items()},
        )
