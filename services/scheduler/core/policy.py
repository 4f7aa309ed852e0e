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
from operator import attrgetter

from libs.protocol.ids import ModelKey
from services.scheduler.core.snapshot import (
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
    ready = set(map(_TENANT, snapshot.ready))
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


class _FreeFns:
    """How many free executors run each ModelFn that ready work needs, kept as executors are taken
    (``_placeable`` recomputed the union of every free executor's ModelFns for every assignment)."""

    __slots__ = ("count",)

    def __init__(self, free: dict[str, ExecutorInfo], needed: set[str]) -> None:
        self.count = {f: sum(1 for e in free.values() if f in e.fns) for f in needed}

    def take(self, ex: ExecutorInfo) -> list[str]:
        """Remove ``ex``; the ModelFns no free executor runs any more."""
        gone = []
        for f, n in self.count.items():
            if n and f in ex.fns:
                self.count[f] = n - 1
                if n == 1:
                    gone.append(f)
        return gone


class _Placer:
    """:func:`best_fit` over a shrinking set of free executors, without scanning all of them per
    node: per model, the free executors sorted once by best_fit's rank without the local-input
    term (most of the model on the device, its bytes in the host tier, least loaded, id); a node
    takes the first of those that runs its ModelFn and has room, compared with the executors that
    hold its inputs (ranked in full). The same executor as :func:`best_fit`, in O(1) per node
    instead of O(free executors) once the order is built."""

    __slots__ = ("free", "head", "order")

    def __init__(self, free: dict[str, ExecutorInfo]) -> None:
        self.free = free  # shared with the caller, who deletes the executors it takes
        self.order: dict[ModelKey, list[tuple[tuple, ExecutorInfo]]] = {}
        self.head: dict[ModelKey, int] = {}

    def best(self, node: ReadyNode) -> ExecutorInfo | None:
        free = self.free
        local: dict[str, int] = {}
        total = 0
        for holder, nbytes in node.inputs:
            local[holder] = local.get(holder, 0) + nbytes
            total += nbytes
        model = node.model_key
        fn = node.fn
        best: tuple | None = None
        choice: ExecutorInfo | None = None
        for holder, here in local.items():
            ex = free.get(holder)
            if ex is None or fn not in ex.fns or (ex.arena_capacity > 0 and total - here > ex.arena_free):
                continue
            frac = 1.0 if model in ex.resident else ex.cached.get(model, 0.0)
            rank = (-frac, model not in ex.host_resident, -here, ex.load, ex.id)
            if best is None or rank < best:
                best, choice = rank, ex
        order = self.order.get(model)
        if order is None:
            order = self.order[model] = sorted(
                (
                    (
                        (
                            -(1.0 if model in e.resident else e.cached.get(model, 0.0)),
                            model not in e.host_resident,
                            e.load,
                            e.id,
                        ),
                        e,
                    )
                    for e in free.values()
                ),
                key=_first,
            )
            self.head[model] = 0
        i = self.head[model]
        while i < len(order) and order[i][1].id not in free:
            i += 1  # taken since: never a candidate again
        self.head[model] = i
        for key, ex in order[i:]:
            if ex.id not in free or ex.id in local or fn not in ex.fns:
                continue
            if ex.arena_capacity > 0 and total > ex.arena_free:
                continue
            rank = (key[0], key[1], 0, key[2], key[3])
            if best is None or rank < best:
                choice = ex
            break
        return choice


def fair(snapshot: Snapshot, slack_s: float = 5.0) -> Decision:
    """The two-layer fair policy of Algorithm 1, once per idle executor.

    Each round: only work some free executor can run counts (work-conserving); Layer 1 admits the
    tenants within ``slack_s`` of the least vTime among tenants with such work; Layer 2 takes the
    admitted node with the best normalised score, ties broken by (arrival, request, order), and
    places it with :func:`best_fit`. The rounds are computed incrementally (per-tenant node lists,
    their extremes and best node cached until that tenant or the normalisers change), which picks
    exactly the node a full scan of the pool would (docs/scheduling.md, "Control-plane speed").
    """
    lifts = vtime_lifts(snapshot, slack_s)
    v = {name: t.vtime for name, t in snapshot.tenants.items()}
    v.update(lifts)
    free = {e.id: e for e in snapshot.idle}
    fns = _FreeFns(free, set(map(_FN, snapshot.ready)))
    placer = _Placer(free)
    now = snapshot.now
    by_tenant: dict[str, list[ReadyNode]] = {}
    count = fns.count
    for n in snapshot.ready:
        if count.get(n.fn, 0) > 0:  # placeable now (executors only go away)
            nodes = by_tenant.get(n.tenant)
            if nodes is None:
                by_tenant[n.tenant] = [n]
            else:
                nodes.append(n)
    extremes: dict[str, tuple[float, float, float]] = {}  # tenant -> (min ready_since, max r, max e)
    best_of: dict[str, tuple[float, ReadyNode]] = {}  # tenant -> (score key, node) under ``norm``
    norm: tuple[float, float, float] | None = None
    out: list[Assignment] = []
    while free and by_tenant:
        # Layer 1: fairness filter over tenants with ready work.
        v_min = min(v.get(t, 0.0) for t in by_tenant)
        admitted = [t for t in by_tenant if v.get(t, 0.0) - v_min <= slack_s]
        for t in admitted:
            if t not in extremes:
                nodes = by_tenant[t]
                extremes[t] = (
                    min(map(_READY_SINCE, nodes)),
                    max(map(_REMAINING, nodes)),
                    max(map(_EST, nodes)),
                )
        # Layer 2: normalised priority score w^ - r^ - e^ (each term divided by its maximum).
        w_max = max(now - extremes[t][0] for t in admitted) or 1.0
        r_max = max(extremes[t][1] for t in admitted) or 1.0
        e_max = max(extremes[t][2] for t in admitted) or 1.0
        if (w_max, r_max, e_max) != norm:
            norm = (w_max, r_max, e_max)
            best_of.clear()
        pick: tuple[float, ReadyNode] | None = None
        for t in admitted:
            cand = best_of.get(t)
            if cand is None:
                cand = best_of[t] = _best_scored(by_tenant[t], now, w_max, r_max, e_max)
            if pick is None or cand[0] < pick[0] or (cand[0] == pick[0] and _tie(cand[1]) < _tie(pick[1])):
                pick = cand
        assert pick is not None
        best = pick[1]
        ex = placer.best(best)
        _drop(by_tenant, extremes, best_of, best)
        if ex is None:  # no idle executor that runs its ModelFn has room for its inputs
            continue
        charge = charge_for(best, ex)
        v[best.tenant] = v.get(best.tenant, 0.0) + charge
        out.append(Assignment(best.ref, ex.id, charge))
        del free[ex.id]
        gone = fns.take(ex)
        if gone:  # work no free executor runs any more leaves the pool
            dead = set(gone)
            for t in list(by_tenant):
                kept = [n for n in by_tenant[t] if n.fn not in dead]
                if len(kept) != len(by_tenant[t]):
                    extremes.pop(t, None)
                    best_of.pop(t, None)
                    if kept:
                        by_tenant[t] = kept
                    else:
                        del by_tenant[t]
    return Decision(out, lifts)


def _first(pair: tuple) -> tuple:
    return pair[0]


_TENANT = attrgetter("tenant")
_FN = attrgetter("fn")
_READY_SINCE = attrgetter("ready_since")
_REMAINING = attrgetter("remaining_s")
_EST = attrgetter("est_s")


def _tie(n: ReadyNode) -> tuple[float, str, int]:
    """Layer 2's tie-break between nodes of equal score: the older request, then its id, then the
    node's topological position."""
    return (n.submitted_at, n.request_id, n.order)


def _best_scored(
    nodes: list[ReadyNode], now: float, w_max: float, r_max: float, e_max: float
) -> tuple[float, ReadyNode]:
    """The node of ``nodes`` with the best score (the least negated score, ties by :func:`_tie`),
    with its negated score. Scores are computed once into a list and compared as floats, without
    a tuple per node (this is most of a round's time with a few hundred ready nodes)."""
    scores = [-((now - n.ready_since) / w_max - n.remaining_s / r_max - n.est_s / e_max) for n in nodes]
    low = min(scores)
    if scores.count(low) == 1:
        return low, nodes[scores.index(low)]
    return low, min((n for n, sc in zip(nodes, scores, strict=True) if sc == low), key=_tie)


def _drop(by_tenant: dict, extremes: dict, best_of: dict, node: ReadyNode) -> None:
    """Take ``node`` out of its tenant's list; that tenant's cached extremes and best go stale."""
    nodes = by_tenant[node.tenant]
    nodes.remove(node)
    extremes.pop(node.tenant, None)
    best_of.pop(node.tenant, None)
    if not nodes:
        del by_tenant[node.tenant]


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
