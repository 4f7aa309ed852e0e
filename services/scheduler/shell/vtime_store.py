"""Tenant counters in Redis, updated atomically by a Lua script (paper §6): one call per change
(:meth:`VTimeStore.apply`) or per batch of changes (:meth:`VTimeStore.apply_many`, what the
scheduler's shell uses: one call per tick).

A scheduler restart reads them back (:meth:`VTimeStore.load`), so vTime survives it. Redis converts
a Lua number in a script's reply to an integer (truncating it), so the script formats floats with
``%.17g`` (round-trip exact) and returns strings.

Fencing (``docs/scheduling.md``, "Fail-over"): every change carries the writer's lease epoch, and
the script refuses it (changing nothing) when a later scheduler has taken the lease since (the
stored ``{ns}:scheduler:epoch`` is higher): :meth:`VTimeStore.apply` then raises :class:`StaleEpoch`
and that scheduler steps down.

GPU-second quotas (``docs/gateway.md``, "Quotas"): the same script adds the measured service to a
per-window hash, ``{ns}:gpu_s:{window_s}:{time // window_s}`` (tenant -> seconds, expiring two
windows after its last write), so the gateway's quota check reads what was charged, in the same
atomic step that charged it. The window length is the gateway's (``T2I_GATEWAY_QUOTA_WINDOW_S``),
which it writes to ``{ns}:gw:quota:window_s`` while quotas are in use: one setting, so the two
cannot disagree. It is read here at most every :attr:`VTimeStore.window_refresh_s`; while it is
not set (no quotas) nothing is counted per window.
"""

from __future__ import annotations

import logging
import time

import msgspec
from redis.asyncio import Redis

from libs.protocol.keys import Keys
from services.scheduler.core.effects import ChargeVTime

log = logging.getLogger(__name__)

# KEYS: vtime, ops, service hashes, epoch, [the quota window's hash]. ARGV: tenant, delta, set
# vtime|'', ops delta, op floor|'', service delta, the writer's epoch, [the window hash's TTL in s].
# A stale writer gets {'stale', the current epoch}. Only HGET/HSET/EXPIRE touch the window hash
# (HINCRBYFLOAT is not among the scheduler's Redis commands: docs/security.md).
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
if KEYS[5] and tonumber(ARGV[6]) ~= 0 then
  local w = tonumber(redis.call('HGET', KEYS[5], t) or '0') + tonumber(ARGV[6])
  redis.call('HSET', KEYS[5], t, string.format('%.17g', w))
  redis.call('EXPIRE', KEYS[5], ARGV[8])
end
return {vs, os, ss}
"""


# Many changes in one call (one per scheduler tick: ``apply_many``), fenced once. KEYS as above;
# ARGV: the writer's epoch, the window hash's TTL in s (or ''), then the changes as one JSON array of
# [tenant, delta, set vtime|null, ops delta, op floor|null, service delta]: one argument, encoded in
# C, where six per change cost the scheduler a twentieth of its time in packing them. Applied in
# order, as one ``_CHARGE`` each (JSON numbers decode to the same doubles: the sums are the same).
_CHARGE_MANY = """
local e = tonumber(redis.call('GET', KEYS[4]) or '0')
if tonumber(ARGV[1]) < e then return {'stale', tostring(e)} end
local changes = cjson.decode(ARGV[3])
for _, c in ipairs(changes) do
  local t = c[1]
  local v = tonumber(redis.call('HGET', KEYS[1], t) or '0')
  if c[3] ~= cjson.null then v = c[3] end
  v = v + c[2]
  redis.call('HSET', KEYS[1], t, string.format('%.17g', v))
  local o = tonumber(redis.call('HGET', KEYS[2], t) or '0')
  if c[5] ~= cjson.null then o = math.max(o, c[5]) end
  o = o + c[4]
  redis.call('HSET', KEYS[2], t, string.format('%d', o))
  local sd = c[6]
  local s = tonumber(redis.call('HGET', KEYS[3], t) or '0') + sd
  redis.call('HSET', KEYS[3], t, string.format('%.17g', s))
  if KEYS[5] and sd ~= 0 then
    local w = tonumber(redis.call('HGET', KEYS[5], t) or '0') + sd
    redis.call('HSET', KEYS[5], t, string.format('%.17g', w))
    redis.call('EXPIRE', KEYS[5], ARGV[2])
  end
end
return {'ok', tostring(#changes)}
"""


class StaleEpoch(RuntimeError):
    """A write refused: another scheduler has taken the lease since this one's epoch."""


class VTimeStore:
    def __init__(self, redis: Redis, keys: Keys, epoch: int = 0) -> None:
        self.redis = redis
        self.keys = keys
        self.epoch = epoch  # the writer's fencing token (the scheduler sets it on taking the lease)
        self._charge = redis.register_script(_CHARGE)
        self._charge_many = redis.register_script(_CHARGE_MANY)
        self.window_refresh_s = 5.0  # how often the quota window's length is read again
        self._window_s = 0
        self._window_read_at = -float("inf")  # monotonic
        self._window_failed = False

    async def window_s(self) -> int:
        """The quota window's length in seconds (0: none), as the gateway set it; cached."""
        now = time.monotonic()
        if now - self._window_read_at < self.window_refresh_s:
            return self._window_s
        self._window_read_at = now
        try:
            raw = await self.redis.get(self.keys.quota_window)
        except Exception as e:  # noqa: BLE001 - not counting per window never stops a charge
            if not self._window_failed:
                log.warning(
                    "reading the quota window failed (%s: %s); not counting per window", type(e).__name__, e
                )
            self._window_failed = True
            return self._window_s
        self._window_failed = False
        try:
            self._window_s = max(0, int(raw or 0))
        except ValueError:
            log.warning("ignored a malformed quota window %r", raw[:40])
            self._window_s = 0
        return self._window_s

    async def apply(self, c: ChargeVTime) -> tuple[float, int, float]:
        """Apply one change; returns the tenant's (vtime, ops, service) after it. Raises
        :class:`StaleEpoch` (nothing changed) when a later scheduler holds the lease."""
        keys = [self.keys.vtime, self.keys.ops, self.keys.service, self.keys.scheduler_epoch]
        extra: list[str] = []
        if c.service_s and (window := await self.window_s()) > 0:
            keys.append(self.keys.gpu_window(window, int(time.time() // window)))
            extra.append(str(2 * window))
        reply = await self._charge(
            keys=keys,
            args=[*_charge_args(c), str(int(self.epoch)), *extra],
        )
        if reply[0] in (b"stale", "stale"):
            current = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            raise StaleEpoch(f"vTime write refused: epoch {self.epoch} < {current}")
        v, o, s = reply
        return float(v), int(o), float(s)

    async def apply_many(self, changes: list[ChargeVTime]) -> None:
        """Apply ``changes`` in order in one atomic script call (a tick's worth: the scheduler's
        shell batches them); raises :class:`StaleEpoch` (nothing changed) when a later scheduler
        holds the lease. Leaves what as many :meth:`apply` calls would."""
        if not changes:
            return
        keys = [self.keys.vtime, self.keys.ops, self.keys.service, self.keys.scheduler_epoch]
        ttl = ""
        if any(c.service_s for c in changes) and (window := await self.window_s()) > 0:
            keys.append(self.keys.gpu_window(window, int(time.time() // window)))
            ttl = str(2 * window)
        batch = msgspec.json.encode(
            [
                [
                    c.tenant,
                    float(c.delta),
                    None if c.set_vtime is None else float(c.set_vtime),
                    int(c.ops),
                    None if c.op_floor is None else int(c.op_floor),
                    float(c.service_s),
                ]
                for c in changes
            ]
        )
        reply = await self._charge_many(keys=keys, args=[str(int(self.epoch)), ttl, batch])
        if reply[0] in (b"stale", "stale"):
            current = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            raise StaleEpoch(f"vTime write refused: epoch {self.epoch} < {current}")

    async def load(self) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
        vt = await self.redis.hgetall(self.keys.vtime)
        ops = await self.redis.hgetall(self.keys.ops)
        svc = await self.redis.hgetall(self.keys.service)
        return (
            {k.decode(): float(v) for k, v in vt.items()},
            {k.decode(): int(v) for k, v in ops.items()},
            {k.decode(): float(v) for k, v in svc.items()},
        )


def _charge_args(c: ChargeVTime) -> list[str]:
    """One change as ``_CHARGE`` reads it: tenant, delta, set_vtime, ops, op_floor, service_s."""
    return [
        c.tenant,
        repr(float(c.delta)),
        "" if c.set_vtime is None else repr(float(c.set_vtime)),
        str(int(c.ops)),
        "" if c.op_floor is None else str(int(c.op_floor)),
        repr(float(c.service_s)),
    ]
