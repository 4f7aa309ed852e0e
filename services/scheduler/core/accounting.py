"""Per-tenant accounting: cumulative vTime, operation counts and measured service (paper §6).

vTime is what the fair policy orders tenants by: every ModelFn execution charges its owner the GPU
time it consumed (loading, computation, tensor transfer, as the executor measures them). At
dispatch the owner is charged an *estimate*; on completion the estimate is replaced by the
measurement (``+= measured − estimate``). Parallel ModelFns of one step are charged separately,
as they are separate nodes. A tenant that is new, or returns after having nothing in progress, is
marked ``returning`` so the policy can lift its vTime to the active tenants' minimum.

``service_s`` sums measured GPU time only (no estimates, no lifts): the quantity fairness is
judged by in the experiments. ``ops`` counts dispatched ModelFns for the VTC baseline.

The in-memory accounts drive scheduling; every change is also emitted as a :class:`ChargeVTime`
effect that the shell applies to Redis atomically, so a restarted scheduler resumes from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.scheduler.core.effects import ChargeVTime
from services.scheduler.core.snapshot import TenantView


@dataclass
class TenantAccount:
    vtime: float = 0.0
    ops: int = 0
    service_s: float = 0.0
    requests: int = 0  # requests in progress
    returning: bool = True  # new, or back after having nothing in progress
    waiting: bool = False  # had ready work left waiting after the last scheduling round


class Accounts:
    def __init__(self) -> None:
        self.tenants: dict[str, TenantAccount] = {}

    def __getitem__(self, tenant: str) -> TenantAccount:
        acct = self.tenants.get(tenant)
        if acct is None:
            acct = self.tenants[tenant] = TenantAccount()
        return acct

    def load(
        self,
        vtime: Mapping[str, float],
        ops: Mapping[str, int] | None = None,
        service: Mapping[str, float] | None = None,
    ) -> None:
        """Resume from persisted counters (a scheduler restart)."""
        for tenant, v in vtime.items():
            self[tenant].vtime = float(v)
        for tenant, n in (ops or {}).items():
            self[tenant].ops = int(n)
        for tenant, s in (service or {}).items():
            self[tenant].service_s = float(s)

    def request_started(self, tenant: str) -> None:
        acct = self[tenant]
        acct.requests += 1
        if acct.requests == 1:
            acct.returning = True

    def request_ended(self, tenant: str) -> None:
        acct = self[tenant]
        acct.requests = max(0, acct.requests - 1)

    def lift(self, tenant: str, vtime: float) -> ChargeVTime | None:
        """Set a joining tenant's vTime (the policy's lift, which may also trim excess credit)."""
        acct = self[tenant]
        if vtime == acct.vtime:
            return None
        acct.vtime = vtime
        return ChargeVTime(tenant, set_vtime=vtime)

    def lift_ops(self, tenant: str, floor: int) -> ChargeVTime | None:
        acct = self[tenant]
        if floor <= acct.ops:
            return None
        acct.ops = floor
        return ChargeVTime(tenant, op_floor=floor)

    def settle(self, tenant: str) -> None:
        """The tenant has been considered for a lift: from now on it is an ordinary active tenant."""
        self[tenant].returning = False

    def charge(self, tenant: str, estimate_s: float) -> ChargeVTime:
        acct = self[tenant]
        acct.vtime += estimate_s
        acct.ops += 1
        return ChargeVTime(tenant, delta=estimate_s, ops=1)

    def correct(self, tenant: str, estimate_s: float, measured_s: float) -> ChargeVTime:
        acct = self[tenant]
        acct.vtime += measured_s - estimate_s
        acct.service_s += measured_s
        return ChargeVTime(tenant, delta=measured_s - estimate_s, service_s=measured_s)

    def refund(self, tenant: str, estimate_s: float) -> ChargeVTime:
        """A dispatch that never ran (the executor did not accept it): undo its charge."""
        acct = self[tenant]
        acct.vtime -= estimate_s
        acct.ops -= 1
        return ChargeVTime(tenant, delta=-estimate_s, ops=-1)

    def views(self) -> dict[str, TenantView]:
        return {
            name: TenantView(
                vtime=a.vtime,
                ops=a.ops,
                returning=a.returning,
                active=a.requests > 0,
                rejoining=not a.waiting and not a.returning,
            )
            for name, a in self.tenants.items()
            if a.requests > 0
        }
