"""Admission: which of the requests taken in from the intake enters the core next (``docs/scheduling.md``).

The core holds at most ``max_active`` requests (the *active set*: the requests whose nodes the policy
sees). The intake pulls up to ``max_backlog`` more and keeps them here, in one queue per tenant, in
the order they arrived at this scheduler. Whenever the active set has room, a request is admitted
from the queue of the tenant the policy would serve first:

* ``fair``: the tenant with the least vTime. A tenant with nothing in the core (a *joiner*) ranks
  at lo, the least vTime of the tenants in the core: it banks no credit from its absence, and
  earlier service does not hold it back either, since the core places it within [lo, lo + Δ] when
  it joins (``policy.vtime_lifts``). Ranking it at lo + Δ instead would starve it behind a single
  backlogged tenant, whose vTime, and so lo, grows with every dispatch. With no tenant in the
  core, joiners are raised to within Δ of the most-served one, as the policy does.
* ``vtc``: the operation count; a joiner's is raised to the least count in the core, never lowered.
* ``fifo`` and ``sjf``: global arrival order (the intake's order, as before admission existed).

Ties go to the tenant with fewer requests in the core, then to the oldest queued request: a joining
tenant placed at the least vTime goes ahead of the tenant that holds the active set. Within a tenant
requests are admitted in arrival order.

Pure: no I/O, no clock. :class:`Backlog` is the queues; a :data:`Rank` picks a tenant from the heads
of the queues and the core's accounts.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

from libs.protocol.messages import ImageRequest
from libs.workflow.dag import Dag
from services.scheduler.core.accounting import TenantAccount


@dataclass(slots=True)
class Queued:
    """A request taken in (its workflow resolved, its attempt counted) and waiting for admission."""

    seq: int  # arrival order at this scheduler
    req: ImageRequest
    dag: Dag = field(repr=False)
    attempt: int
    deadline: float  # monotonic

    @property
    def tenant(self) -> str:
        return self.req.tenant


# rank(heads, tenants) -> the tenant to admit from: ``heads`` is each queued tenant's oldest request,
# ``tenants`` the core's accounts (``SchedulerCore.accounts.tenants``; read, never changed).
Rank = Callable[[Mapping[str, Queued], Mapping[str, TenantAccount]], str]


class Backlog:
    """Requests waiting for admission, one queue per tenant, each in arrival (``seq``) order."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Queued]] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Queued]:
        for q in self._queues.values():
            yield from q

    def counts(self) -> dict[str, int]:
        """Queued requests per tenant."""
        return {t: len(q) for t, q in self._queues.items()}

    def count(self, tenant: str) -> int:
        """Queued requests of ``tenant``."""
        q = self._queues.get(tenant)
        return len(q) if q is not None else 0

    def push(self, item: Queued) -> None:
        q = self._queues.setdefault(item.tenant, deque())
        if not q or q[-1].seq < item.seq:
            q.append(item)  # the usual case: taken in in arrival order
        else:  # taken in late (its take-in retried): back in its place
            seqs = [x.seq for x in q]
            q.insert(bisect.bisect_left(seqs, item.seq), item)
        self._n += 1

    def pop(self, rank: Rank, tenants: Mapping[str, TenantAccount]) -> Queued | None:
        """The next request to admit (removed), or None when nothing is queued."""
        if not self._queues:
            return None
        tenant = rank({t: q[0] for t, q in self._queues.items()}, tenants)
        q = self._queues[tenant]
        item = q.popleft()
        if not q:
            del self._queues[tenant]
        self._n -= 1
        return item

    def remove(self, request_id: str) -> Queued | None:
        """Take a queued request out (it was cancelled); None when it is not queued here."""
        for tenant, q in self._queues.items():
            for item in q:
                if item.req.request_id == request_id:
                    q.remove(item)
                    if not q:
                        del self._queues[tenant]
                    self._n -= 1
                    return item
        return None

    def expired(self, now: float) -> list[Queued]:
        """Remove and return the queued requests whose deadline has passed."""
        out: list[Queued] = []
        for tenant, q in list(self._queues.items()):
            if not any(now >= x.deadline for x in q):
                continue
            keep = deque(x for x in q if now < x.deadline)
            out += [x for x in q if now >= x.deadline]
            if keep:
                self._queues[tenant] = keep
            else:
                del self._queues[tenant]
        self._n -= len(out)
        return out


def by_arrival(heads: Mapping[str, Queued], tenants: Mapping[str, TenantAccount]) -> str:
    """Global arrival order (``fifo``, ``sjf``)."""
    return min(heads, key=lambda t: heads[t].seq)


def by_counter(
    heads: Mapping[str, Queued],
    tenants: Mapping[str, TenantAccount],
    *,
    counter: Callable[[TenantAccount], float],
    slack: float,
    lower: bool,
) -> str:
    """The tenant with the least ``counter`` (vTime, or operations); a joiner (nothing in the core)
    is raised to the least counter in the core, and brought down to it too when ``lower``; with
    nobody in the core joiners are raised to within ``slack`` of the largest. Ties go to fewer
    requests in the core, then to the oldest queued request."""
    active = [counter(a) for a in tenants.values() if a.requests > 0]
    key: dict[str, float] = {}
    joining: list[str] = []
    for t in heads:
        a = tenants.get(t)
        key[t] = counter(a) if a is not None else 0.0
        if a is None or a.requests == 0:
            joining.append(t)
    if active:
        lo = min(active)
        for t in joining:
            key[t] = lo if lower else max(key[t], lo)
    elif joining:
        floor = max(key[t] for t in joining) - slack
        for t in joining:
            key[t] = max(key[t], floor)

    def requests(t: str) -> int:
        a = tenants.get(t)
        return a.requests if a is not None else 0

    return min(heads, key=lambda t: (key[t], requests(t), heads[t].seq))


def rank_for(policy: str, slack_s: float = 5.0) -> Rank:
    """The admission order that goes with a scheduling policy (see the module docstring)."""
    if policy == "fair":
        return partial(by_counter, counter=_vtime, slack=slack_s, lower=True)  # partials pickle (replay.py)
    if policy == "vtc":
        return partial(by_counter, counter=_ops, slack=math.inf, lower=False)
    return by_arrival


def _vtime(a: TenantAccount) -> float:
    return a.vtime


def _ops(a: TenantAccount) -> float:
    return float(a.ops)
