"""Tenant counters in Redis, updated atomically by one Lua script per change (paper §6).

A scheduler restart reads them back (:meth:`VTimeStore.load`), so vTime survives it. Redis converts
a Lua number in a script's reply to an integer (truncating it), so the script formats floats with
``%.17g`` (round-trip exact) and returns strings.

Fencing (``docs/scheduling.md``, "Fail-over"): every change carries the writer's lease epoch, and
the script refuses it (changing nothing) when a later scheduler has taken the lease since (the
stored ``{ns}:scheduler:epoch`` is higher): :meth:`VTimeStore.apply` then raises :class:`StaleEpoch`
and that scheduler steps down.
"""

from __future__ import annotations

from redis.asyncio import Redis

from libs.protocol.keys import Keys
from services.scheduler.effects import ChargeVTime

# KEYS: vtime, ops, service hashes, epoch. ARGV: tenant, delta, set vtime|'', ops delta, op floor|'',
# service delta, the writer's epoch. A stale writer gets {'stale', the current epoch}.
_CHARGE = """
local e = tonumber(redis.call('GET', KEYS[4]) or '0')
if tonumber(ARGV[7]) < e then return {'stale', tostring(e)} end
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


class StaleEpoch(RuntimeError):
    """A write refused: another scheduler has taken the lease since this one's epoch."""


class VTimeStore:
    def __init__(self, redis: Redis, keys: Keys, epoch: int = 0) -> None:
        self.redis = redis
        self.keys = keys
        self.epoch = epoch  # the writer's fencing token (the scheduler sets it on taking the lease)
        self._charge = redis.register_script(_CHARGE)

    async def apply(self, c: ChargeVTime) -> tuple[float, int, float]:
        """Apply one change; returns the tenant's (vtime, ops, service) after it. Raises
        :class:`StaleEpoch` (nothing changed) when a later scheduler holds the lease."""
        reply = await self._charge(
            keys=[self.keys.vtime, self.keys.ops, self.keys.service, self.keys.scheduler_epoch],
            args=[
                c.tenant,
                repr(float(c.delta)),
                "" if c.set_vtime is None else repr(float(c.set_vtime)),
                str(int(c.ops)),
                "" if c.op_floor is None else str(int(c.op_floor)),
                repr(float(c.service_s)),
                str(int(self.epoch)),
            ],
        )
        if reply[0] in (b"stale", "stale"):
            current = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            raise StaleEpoch(f"vTime write refused: epoch {self.epoch} < {current}")
        v, o, s = reply
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
