"""The scheduler lease: at most one scheduler of a namespace leads (``docs/scheduling.md``, "Fail-over").

The lease is one Redis key (``{ns}:scheduler:lease``) holding the leader's id with a TTL. It is
taken with ``SET NX PX`` and, in the same script, the fencing token ``{ns}:scheduler:epoch`` is
incremented: every acquisition gets a higher epoch than any before. The leader renews it every
``ttl/3`` with a compare-and-set script (only while it is still its own) and deletes it (again only
if its own) on a clean stop. The epoch goes with everything the leader does that a replaced leader
must not do: executors refuse dispatches with a lower one, the vTime script refuses writes.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

from redis.asyncio import Redis

from libs.common.redis_conn import DELETE_IF_HELD, RENEW_IF_HELD
from libs.protocol.keys import Keys

# KEYS: lease, epoch. ARGV: holder, ttl ms. The new epoch, or 0 when another holds the lease.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0
"""


class LeaseLost(RuntimeError):
    """This scheduler is no longer the leader (or cannot tell): it must stop acting at once."""


class Lease:
    def __init__(self, redis: Redis, keys: Keys, ttl_s: float, holder: str | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.epoch = 0  # the fencing token of the current (or last) acquisition; 0: never led
        self.held = False
        self.valid_until = 0.0  # monotonic: the lease may have expired in Redis from then on
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(RENEW_IF_HELD)
        self._release = redis.register_script(DELETE_IF_HELD)

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    async def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; True (and a new epoch) when taken."""
        sent = time.monotonic()
        epoch = int(await self._acquire(keys=[self.keys.scheduler_lease, self.keys.scheduler_epoch],
                                        args=[self.holder, self._ttl_ms]))  # fmt: skip
        if not epoch:
            return False
        self.epoch, self.held, self.valid_until = epoch, True, sent + self.ttl_s
        return True

    async def renew(self) -> bool:
        """Extend the lease; False when it is not ours any more (raises on a Redis error)."""
        sent = time.monotonic()
        ok = int(await self._renew(keys=[self.keys.scheduler_lease], args=[self.holder, self._ttl_ms]))
        if ok:
            self.valid_until = sent + self.ttl_s  # counted from before the call: never too late
        else:
            self.held = False
        return bool(ok)

    async def release(self) -> None:
        """Give the lease up (a clean stop): a standby takes over at its next poll."""
        if not self.held:
            return
        self.held = False
        await self._release(keys=[self.keys.scheduler_lease], args=[self.holder])

    async def holder_now(self) -> str | None:
        v = await self.redis.get(self.keys.scheduler_lease)
        return None if v is None else v.decode()
