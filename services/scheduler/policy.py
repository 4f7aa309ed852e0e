"""Scheduling policies: pure functions ``policy(snapshot) -> Decision``, selected by name.

* ``fair`` — the paper's two-layer scheduler (§6, Algorithm 1): vTime lift for new and returning
  tenants; Layer 1 admits tenants within the slack Δ of the least-served tenant with ready work;
  Layer 2 dispatches the admitted node with the highest normalised score ŵ − r̂ − ê (waiting time,
  remaining critical-path time, execution time) to its best-fit executor, and charges its estimate.
* ``fifo`` — requests in arrival order (each request's nodes in topological order).
* ``sjf`` — shortest job first: the request with the least estimated total work first.
* ``vtc`` — Virtual Token Counter adapted as in paper §6: counts workflow *operations*
  (dispatched ModelFns) per tenant instead of GPU time, serving the tenant with the fewest, with
  the same lift.

Every policy places with :func:`best_fit` (which skips executors without arena room for a node's
remote inputs) and reports the estimate to charge, so vTime accounting is the same whichever policy
orders the work; only the order differs. Policies see only the snapshot: no I/O, no clock, no
mutation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from services.scheduler.snapshot import (
    Assignment,
    Decision,
    ExecutorInfo,
    ReadyNode,
    Snapshot,
    best_fit,
    charge_for,
    place_in_order,
)

Policy = Callable[[Snapshot], Decision]


def fifo(snapshot: Snapshot) -> Decision:
    """First come, first served: the oldest request's ready nodes go first."""
    ordered = sorted(snapshot.ready, key=lambda n: (n.submitted_at, n.request_id, n.order))
    return Decision(place_in_order(ordered, snapshot))


def sjf(snapshot: Snapshot) -> Decision:
    """Shortest job first: requests with the least estimated total work go first."""
    ordered = sorted(snapshot.ready, key=lambda n: (n.job_s, n.submitted_at, n.request_id, n.order))
    return Decision(place_in_order(ordered, snapshot))


def vtime_lifts(snapshot: Snapshot, slack_s: float = 0.0) -> dict[str, float]:
    """Algorithm 1, lines 2–3, for DAG workloads: the vTime of a tenant that *joins* the tenants
    with ready work waiting, whether it is new, returning after inactivity, or rejoining after all
    its work was running or blocked on predecessors.

    The paper lifts a new or returning tenant to the minimum vTime of the active tenants, so that
    past absence is not banked as priority. Generalised:

    * With eligible tenants E (ready work that waited since the last round), a joiner's vTime is
      brought into [min(E), min(E) + Δ]. It keeps no credit, because it was not competing for
      what others got meanwhile. It also carries at most Δ of excess service, because what it
      received while nobody else was waiting took nothing from anyone.
    * With none (everyone joins at once), the joiners are lifted to within Δ of the most-served
      joiner.

    Eligible tenants stay within Δ + L_max of each other under Layer 1. Joiners placed this way
    start within Δ + L_max of every one of them, which makes the bound of paper §6 hold for every
    interval in which two tenants are eligible-backlogged. Lifting only up, or only against the
    continuously waiting tenants, does not: ``tests/unit/test_fairness_bound.py`` has the
    counterexamples hypothesis found.
    """
    ready = {n.tenant for n in snapshot.ready}
    tenants = snapshot.tenants
    eligible = [t.vtime for n, t in tenants.items() if n in ready and not t.returning and not t.rejoining]
    joining = {n: t for n, t in tenants.items() if n in ready and (t.returning or t.rejoining)}
    lifts: dict[str, float] = {}
    if eligible:
        lo = min(eligible)
        for name, t in joining.items():
            v = min(max(t.vtime, lo), lo + slack_s)
            if v != t.vtime:
                lifts[name] = v
    elif joining:
        floor = max(t.vtime for t in joining.values()) - slack_s
        lifts = {name: floor for name, t in joining.items() if t.vtime < floor}
    return lifts


def _placeable(nodes: list[ReadyNode], free: dict[str, ExecutorInfo]) -> list[ReadyNode]:
    fns = set().union(*(e.fns for e in free.values())) if free else set()
    return [n for n in nodes if n.fn in fns]


def fair(snapshot: Snapshot, slack_s: float = 5.0) -> Decision:
    """The two-layer fair policy of Algorithm 1, once per idle executor."""
    lifts = vtime_lifts(snapshot, slack_s)
    v = {name: t.vtime for name, t in snapshot.tenants.items()}
    v.update(lifts)
    free = {e.id: e for e in snapshot.idle}
    remaining = list(snapshot.ready)
    now = snapshot.now
    out: list[Assignment] = []
    while free and remaining:
        # Only work some idle executor can run counts, so the policy stays work-conserving.
        candidates = _placeable(remaining, free)
        if not candidates:
            break
        # Layer 1: fairness filter over tenants with ready work.
        tenants = {n.tenant for n in candidates}
        v_min = min(v.get(t, 0.0) for t in tenants)
        admitted = {t for t in tenants if v.get(t, 0.0) - v_min <= slack_s}
        pool = [n for n in candidates if n.tenant in admitted]
        # Layer 2: normalised priority score w^ - r^ - e^ (each term divided by its maximum).
        w_max = max(now - n.ready_since for n in pool) or 1.0
        r_max = max(n.remaining_s for n in pool) or 1.0
        e_max = max(n.est_s for n in pool) or 1.0

        def score(n: ReadyNode, w_max: float = w_max, r_max: float = r_max, e_max: float = e_max) -> tuple:
            s = (now - n.ready_since) / w_max - n.remaining_s / r_max - n.est_s / e_max
            return (-s, n.submitted_at, n.request_id, n.order)

        best = min(pool, key=score)
        ex = best_fit(best, free.values())
        if ex is None:  # no idle executor that runs its ModelFn has room for its inputs
            remaining.remove(best)
            continue
        charge = charge_for(best, ex)
        v[best.tenant] = v.get(best.tenant, 0.0) + charge
        out.append(Assignment(best.ref, ex.id, charge))
        remaining.remove(best)
        del free[ex.id]
    return Decision(out, lifts)


def vtc(snapshot: Snapshot) -> Decision:
    """VTC adapted to workflows: serve the tenant with the fewest dispatched operations."""
    ready = {n.tenant for n in snapshot.ready}
    settled = [t.ops for name, t in snapshot.tenants.items() if t.active and not t.returning]
    floor = min(settled) if settled else None
    op_lifts = {
        name: floor
        for name, t in snapshot.tenants.items()
        if floor is not None and t.returning and name in ready and t.ops < floor
    }
    ops = {name: t.ops for name, t in snapshot.tenants.items()}
    ops.update(op_lifts)
    free = {e.id: e for e in snapshot.idle}
    remaining = list(snapshot.ready)
    out: list[Assignment] = []
    while free and remaining:
        candidates = _placeable(remaining, free)
        if not candidates:
            break
        best = min(candidates, key=lambda n: (ops.get(n.tenant, 0), n.submitted_at, n.request_id, n.order))
        ex = best_fit(best, free.values())
        if ex is None:  # no idle executor that runs its ModelFn has room for its inputs
            remaining.remove(best)
            continue
        ops[best.tenant] = ops.get(best.tenant, 0) + 1
        out.append(Assignment(best.ref, ex.id, charge_for(best, ex)))
        remaining.remove(best)
        del free[ex.id]
    return Decision(out, op_lifts=op_lifts)


POLICIES = ("fair", "fifo", "sjf", "vtc")


def get_policy(name: str, slack_s: float = 5.0) -> Policy:
    """A policy by name; ``slack_s`` is the fair policy's Δ (seconds of vTime)."""
    if name == "fair":
        if slack_s < 0:
            raise ValueError(f"the fairness slack must be >= 0, got {slack_s}")
        return partial(fair, slack_s=slack_s)
    table: dict[str, Policy] = {"fifo": fifo, "sjf": sjf, "vtc": vtc}
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {list(POLICIES)}") from None
