"""Admission at the gateway: how many images may be in progress, in all and per tenant.

A call for ``n`` images takes ``n`` slots of the global limit (``T2I_GATEWAY_MAX_INFLIGHT``) and of
its tenant's (``T2I_GATEWAY_TENANT_INFLIGHT``) until its images have finished — not until its HTTP
connection ends: a client that hangs up does not free GPU work, so it does not free slots either.
A call that does not fit gets 429 with ``Retry-After``; one tenant at its limit leaves the others'
slots alone. The counters are per gateway process (each replica admits on its own); the
scheduler's fair policy shares the executors among the tenants admitted.
"""

from __future__ import annotations

from collections import Counter

from services.gateway.errors import ApiError, invalid

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self.inflight = 0
        self.by_tenant: Counter[str] = Counter()

    def admit(self, tenant: str, n: int) -> None:
        """Take ``n`` slots for ``tenant``, or raise 429 (422 when ``n`` could never fit)."""
        if n > self.per_tenant:
            raise invalid(
                "n", f"must be at most {self.per_tenant}, the images one tenant may have in progress"
            )
        if self.by_tenant[tenant] + n > self.per_tenant:
            raise ApiError(
                429,
                f"too many images in progress for tenant {tenant!r} (limit {self.per_tenant}); retry shortly",
                code="tenant_busy",
                retry_after=RETRY_AFTER_S,
            )
        if self.inflight + n > self.total:
            raise ApiError(
                429,
                f"too many images in progress (limit {self.total}); retry shortly",
                code="busy",
                retry_after=RETRY_AFTER_S,
            )
        self.inflight += n
        self.by_tenant[tenant] += n

    def release(self, tenant: str, n: int) -> None:
        self.inflight -= n
        self.by_tenant[tenant] -= n
        if self.by_tenant[tenant] <= 0:
            del self.by_tenant[tenant]
