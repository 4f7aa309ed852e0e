"""Per-tenant limits that hold across the whole platform: requests queued, and GPU-second quotas.

The in-flight limit (``admission.py``) is counted in each gateway process. These two are counted
where the work is, so every gateway replica sees the same numbers:

* **Queued** (``T2I_GATEWAY_TENANT_QUEUED``): a tenant's requests taken in but not started — those
  in the scheduler's core that have not started (``queued`` in its operator view, ``{ns}:tenants``)
  plus those it holds for admission (``{ns}:backlog``, written by its intake). A call whose ``n``
  images would take the tenant past the limit gets 429 ``tenant_queue_full``.
* **GPU seconds** (``T2I_GATEWAY_TENANT_GPU_S`` per ``T2I_GATEWAY_QUOTA_WINDOW_S``): the measured
  GPU time charged to the tenant in the current window, ``{ns}:gpu_s:{window_s}:{time // window_s}``,
  which the scheduler's vTime script adds to in the same atomic step as every charge
  (``services/scheduler/shell/vtime_store.py``). A tenant at or past its quota gets 429 ``quota_exceeded``
  with ``Retry-After`` the seconds until the window ends. The window's length is this gateway's:
  it writes it to ``{ns}:gw:quota:window_s`` while a quota is in use, and the scheduler counts in it.

An admin may override either limit per tenant (``{ns}:gw:limits:{tenant}``, JSON ``{"queued": …,
"gpu_s": …}``; 0 is unlimited, an absent field the gateway's default).

The numbers are read at most every :data:`CACHE_S` per tenant (one pipelined round trip), and they
lag: the scheduler refreshes its view every ``T2I_SCHEDULER_VIEW_S`` and charges a node when it
completes. So a burst may pass the queued limit by what one gateway admits in that time (bounded
by its in-flight limit), and a tenant may run past its quota by the work it had in progress; the
scheduler's ``max_tenant_backlog`` is the hard cap on what it holds. Anything unreadable (Redis
away, or a Redis user without the keys) counts as zero: these limits fail open, logged once.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from redis.asyncio import Redis

from libs.protocol.keys import Keys
from services.gateway.admission import RETRY_AFTER_S
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, invalid

log = logging.getLogger(__name__)

CACHE_S = 0.5  # how long a tenant's counts are reused before Redis is read again
ANNOUNCE_S = 30.0  # how often the quota window is written again while a quota is in use
WINDOW_KEY_TTL_S = 86400  # a window no gateway has used for this long stops being counted


class Overrides(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """An admin's per-tenant limits; None: the gateway's default; 0: unlimited."""

    queued: int | None = None
    gpu_s: float | None = None


@dataclass
class Usage:
    """A tenant's counts as last read (``read_at`` monotonic; ``window`` the quota window index)."""

    queued: int = 0
    gpu_s: float = 0.0
    window: int = 0
    overrides: Overrides = field(default_factory=Overrides)
    read_at: float = -math.inf


class TenantLimits:
    def __init__(self, cfg: GatewayConfig, redis: Redis, keys: Keys) -> None:
        self.cfg = cfg
        self.redis = redis
        self.keys = keys
        self.window_s = max(1, int(cfg.quota_window_s))
        self._cache: dict[str, Usage] = {}
        self._announced_at = -math.inf
        self._failed: set[str] = set()  # what could not be read (logged once until it reads again)

    # -- limits -------------------------------------------------------------------------------------
    def queued_limit(self, o: Overrides) -> int:
        return self.cfg.tenant_queued if o.queued is None else o.queued

    def gpu_limit(self, o: Overrides) -> float:
        return self.cfg.tenant_gpu_s if o.gpu_s is None else o.gpu_s

    def window_index(self, now: float | None = None) -> int:
        return int((time.time() if now is None else now) // self.window_s)

    def window_left_s(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        return (self.window_index(now) + 1) * self.window_s - now

    async def check(self, tenant: str, n: int) -> None:
        """Raise 429 if ``tenant`` is over its queued limit or GPU-second quota (422 when ``n``
        images could never fit its queued limit)."""
        usage = await self.usage(tenant)
        queued_limit = self.queued_limit(usage.overrides)
        if queued_limit > 0:
            if n > queued_limit:
                raise invalid(
                    "n", f"must be at most {queued_limit}, the requests this tenant may have queued"
                )
            if usage.queued + n > queued_limit:
                raise ApiError(
                    429,
                    f"too many requests queued for tenant {tenant!r}: {usage.queued} queued, limit "
                    f"{queued_limit}; retry once some have started",
                    code="tenant_queue_full",
                    retry_after=RETRY_AFTER_S,
                )
        gpu_limit = self.gpu_limit(usage.overrides)
        if gpu_limit > 0:
            await self.announce_window()
            if usage.gpu_s >= gpu_limit:
                left = max(1, math.ceil(self.window_left_s()))
                raise ApiError(
                    429,
                    f"tenant {tenant!r} has used {usage.gpu_s:.1f} GPU-seconds of its quota of "
                    f"{gpu_limit:g} GPU-seconds per {self.window_s} s; the window ends in {left} s",
                    code="quota_exceeded",
                    retry_after=left,
                )

    def admitted(self, tenant: str, n: int) -> None:
        """Count ``n`` images just admitted as queued until the next read, so a burst from this
        gateway counts itself before the scheduler's view shows it."""
        cached = self._cache.get(tenant)
        if cached is not None:
            cached.queued += n

    async def usage(self, tenant: str) -> Usage:
        """The tenant's counts and overrides, read again when older than :data:`CACHE_S` or from an
        earlier quota window."""
        now, index = time.monotonic(), self.window_index()
        cached = self._cache.get(tenant)
        if cached is not None and now - cached.read_at < CACHE_S and cached.window == index:
            return cached
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.tenants, tenant)
        pipe.hget(self.keys.backlog, tenant)
        pipe.get(self.keys.tenant_limits(tenant))
        pipe.hget(self.keys.gpu_window(self.window_s, index), tenant)
        try:
            view, backlog, overrides, gpu_s = await pipe.execute(raise_on_error=False)
        except Exception as e:  # noqa: BLE001 - Redis away: fail open (the scheduler still caps)
            view = backlog = overrides = gpu_s = e
        usage = Usage(
            queued=self._read("the tenant view", view, _view_queued)
            + self._read("the backlog counts", backlog, lambda raw: int(raw)),
            gpu_s=self._read("the GPU-second window", gpu_s, lambda raw: float(raw)),
            window=index,
            overrides=self._read("the tenant's limits", overrides, _overrides, Overrides()),
            read_at=now,
        )
        if len(self._cache) > 10_000:  # tenants come from the API keys; this only bounds a leak
            self._cache.clear()
        self._cache[tenant] = usage
        return usage

    def _read(self, what: str, raw: Any, parse: Any, default: Any = 0) -> Any:
        if isinstance(raw, Exception):
            if what not in self._failed:
                log.warning("reading %s failed (%s: %s); counted as none", what, type(raw).__name__, raw)
                self._failed.add(what)
            return default
        self._failed.discard(what)
        if raw is None:
            return default
        try:
            return parse(raw)
        except (ValueError, TypeError, AttributeError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("ignored a malformed value of %s: %s", what, e)
            return default

    async def announce_window(self, force: bool = False) -> None:
        """Tell the scheduler the quota window (at most every :data:`ANNOUNCE_S`)."""
        now = time.monotonic()
        if not force and now - self._announced_at < ANNOUNCE_S:
            return
        self._announced_at = now
        try:
            await self.redis.set(self.keys.quota_window, str(self.window_s), ex=WINDOW_KEY_TTL_S)
        except Exception as e:  # noqa: BLE001 - tried again later; until then nothing is counted
            log.warning("writing the quota window failed: %s: %s", type(e).__name__, e)
            self._announced_at = -math.inf

    # -- overrides (admin) -----------------------------------------------------------------------------
    async def set_overrides(self, tenant: str, o: Overrides) -> None:
        key = self.keys.tenant_limits(tenant)
        if o.queued is None and o.gpu_s is None:
            await self.redis.delete(key)
        else:
            await self.redis.set(key, msgspec.json.encode(o))
        self._cache.pop(tenant, None)
        if o.gpu_s:
            await self.announce_window(force=True)

    async def describe(self, tenant: str) -> dict[str, Any]:
        """The tenant's effective limits, its overrides and what it has used (admin view)."""
        self._cache.pop(tenant, None)
        u = await self.usage(tenant)
        return {
            "tenant": tenant,
            "queued": {"limit": self.queued_limit(u.overrides), "used": u.queued},
            "gpu_s": {
                "limit": self.gpu_limit(u.overrides),
                "used": u.gpu_s,
                "window_s": self.window_s,
                "window_ends_in_s": round(self.window_left_s(), 3),
            },
            "overrides": msgspec.to_builtins(u.overrides),
        }


def parse_overrides(body: dict[str, Any]) -> Overrides:
    """An admin's ``PUT /v1/admin/tenants/{tenant}/limits`` body: ``queued`` (a non-negative
    integer) and ``gpu_s`` (a non-negative number), each optional; null removes an override."""
    for key in body:
        if key not in ("queued", "gpu_s"):
            raise invalid(key, "unknown field (expected queued, gpu_s)")
    queued, gpu_s = body.get("queued"), body.get("gpu_s")
    if queued is not None and (not isinstance(queued, int) or isinstance(queued, bool) or queued < 0):
        raise invalid("queued", "must be a non-negative integer (0: unlimited) or null")
    if gpu_s is not None and (
        not isinstance(gpu_s, int | float) or isinstance(gpu_s, bool) or not 0 <= gpu_s < math.inf
    ):
        raise invalid("gpu_s", "must be a non-negative number of GPU-seconds (0: unlimited) or null")
    return Overrides(queued=queued, gpu_s=None if gpu_s is None else float(gpu_s))


def _view_queued(raw: bytes) -> int:
    return int(msgspec.json.decode(raw).get("queued", 0))


def _overrides(raw: bytes) -> Overrides:
    return msgspec.json.decode(raw, type=Overrides)
