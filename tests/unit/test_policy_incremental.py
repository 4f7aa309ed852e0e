"""The fair policy's incremental rounds decide exactly what a full scan per round decides.

``policy.fair`` keeps per-tenant node lists, their extremes and best node, and places with
``_Placer`` (executors pre-sorted per model) instead of scanning every ready node and every free
executor per assignment (docs/scheduling.md, "Control-plane speed"). ``reference_fair`` below is
the full-scan policy as it was; random snapshots must get identical decisions from both.
"""

from __future__ import annotations

import random
from types import MappingProxyType

import pytest

from libs.protocol.ids import ModelKey, NodeRef
from services.scheduler.core.policy import _placeable, _Placer, fair, vtime_lifts
from services.scheduler.core.snapshot import (
    Assignment,
    Decision,
    ExecutorInfo,
    ReadyNode,
    Snapshot,
    TenantView,
    best_fit,
    charge_for,
)

FNS = ["text", "dit", "vae", "prep"]
MODELS = ["a", "b", "c"]


def reference_fair(snapshot: Snapshot, slack_s: float = 5.0) -> Decision:
    lifts = vtime_lifts(snapshot, slack_s)
    v = {name: t.vtime for name, t in snapshot.tenants.items()}
    v.update(lifts)
    free = {e.id: e for e in snapshot.idle}
    remaining = list(snapshot.ready)
    now = snapshot.now
    out: list[Assignment] = []
    while free and remaining:
        candidates = _placeable(remaining, free)
        if not candidates:
            break
        tenants = {n.tenant for n in candidates}
        v_min = min(v.get(t, 0.0) for t in tenants)
        admitted = {t for t in tenants if v.get(t, 0.0) - v_min <= slack_s}
        pool = [n for n in candidates if n.tenant in admitted]
        w_max = max(now - n.ready_since for n in pool) or 1.0
        r_max = max(n.remaining_s for n in pool) or 1.0
        e_max = max(n.est_s for n in pool) or 1.0

        def score(n: ReadyNode, w_max: float = w_max, r_max: float = r_max, e_max: float = e_max) -> tuple:
            s = (now - n.ready_since) / w_max - n.remaining_s / r_max - n.est_s / e_max
            return (-s, n.submitted_at, n.request_id, n.order)

        best = min(pool, key=score)
        ex = best_fit(best, free.values())
        if ex is None:
            remaining.remove(best)
            continue
        charge = charge_for(best, ex)
        v[best.tenant] = v.get(best.tenant, 0.0) + charge
        out.append(Assignment(best.ref, ex.id, charge))
        remaining.remove(best)
        del free[ex.id]
    return Decision(out, lifts)


def random_snapshot(rng: random.Random) -> Snapshot:
    n_ex = rng.randint(0, 12)
    ids = [f"e{i:02d}" for i in range(n_ex)]
    idle = []
    for eid in ids:
        keys = [ModelKey(f, m) for f in FNS for m in MODELS]
        resident = frozenset(k for k in keys if rng.random() < 0.2)
        cached = {k: rng.choice([0.25, 0.5, 0.75]) for k in keys if k not in resident and rng.random() < 0.2}
        cached.update(dict.fromkeys(resident, 1.0))
        cap = rng.choice([0, 1000])
        idle.append(
            ExecutorInfo(
                id=eid,
                fns=frozenset(f for f in FNS if rng.random() < 0.8),
                resident=resident,
                load=rng.choice([0.0, 0.5, 1.0, 2.0]),
                arena_free=rng.randint(0, 1000),
                arena_capacity=cap,
                host_resident=frozenset(k for k in keys if rng.random() < 0.2),
                cached=MappingProxyType(cached),
            )
        )
    tenants = [f"t{i}" for i in range(rng.randint(1, 4))]
    ready = []
    for r in range(rng.randint(0, 6)):
        tenant = rng.choice(tenants)
        for k in range(rng.randint(1, 4)):
            holders = rng.sample(ids, min(len(ids), rng.randint(0, 2))) + (
                ["gone"] if rng.random() < 0.2 else []
            )
            ready.append(
                ReadyNode(
                    ref=NodeRef(f"r{r}", 0, f"n{k}"),
                    tenant=tenant,
                    fn=rng.choice(FNS),
                    model=rng.choice(MODELS),
                    order=k,
                    submitted_at=rng.choice([0.0, 1.0, 2.0]),
                    ready_since=rng.choice([0.0, 3.0, 5.0, 9.0]),
                    inputs=tuple((h, rng.choice([0, 100, 600])) for h in holders),
                    est_s=rng.choice([0.0, 0.1, 0.5, 2.0]),
                    load_s=rng.choice([0.0, 1.0]),
                    remaining_s=rng.choice([0.0, 1.0, 4.0]),
                    load_host_s=rng.choice([0.0, 0.5]),
                )
            )
    views = {
        t: TenantView(
            vtime=rng.choice([0.0, 2.0, 6.0, 12.0]),
            returning=rng.random() < 0.2,
            rejoining=rng.random() < 0.2,
        )
        for t in tenants
    }
    return Snapshot(now=10.0, ready=tuple(ready), idle=tuple(idle), tenants=views)


@pytest.mark.parametrize("seed", range(40))
def test_fair_matches_the_full_scan(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        snap = random_snapshot(rng)
        slack = rng.choice([0.0, 1.0, 5.0])
        assert fair(snap, slack) == reference_fair(snap, slack)


@pytest.mark.parametrize("seed", range(20))
def test_placer_matches_best_fit(seed: int) -> None:
    rng = random.Random(1000 + seed)
    for _ in range(50):
        snap = random_snapshot(rng)
        free = {e.id: e for e in snap.idle}
        placer = _Placer(free)
        for n in rng.sample(list(snap.ready), len(snap.ready)):
            want = best_fit(n, free.values())
            assert placer.best(n) == want
            if want is not None and rng.random() < 0.7:
                del free[want.id]
