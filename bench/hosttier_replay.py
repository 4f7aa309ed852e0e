"""Host-tier trace replay (ServerlessT2I, arXiv 2607.26566, Appendix A): how often does a request
need weights that host memory does not hold, as a function of host-memory capacity?

A skewed trace (``libs.sim.trace``, Zipf workflow popularity) over the S2 workflows
(``libs.sim.settings``) is replayed against a host-memory cache of model weights, keyed by model
(components shared between workflows, e.g. ``flux1/text`` or ``qwen3-4b/text``, are held once),
with sizes from ``libs/sim/profiles/paper-s.json``. On each request every model of its workflow is
looked up; missing ones are read from external storage and inserted, evicting others (never a
model of the current request) until they fit. Capacities are fractions of the total bytes of all
distinct models. Two policies:

* **LRU**: evict the least recently used model (what ``libs.dataplane.hosttier`` does; its eviction
  lives inside the shared-memory index, so this replay uses a small model of it);
* **LFU**: evict the model with the fewest requests so far (counts kept for every model ever seen,
  ties broken by recency).

Two miss rates: **requests** (the paper's: the fraction of requests with at least one model not in
host memory) and **bytes** (bytes read from external storage over bytes requested). The first
``--warmup`` requests fill the cache and are not counted. Writes ``bench/results/hosttier_replay.png``
and ``.json`` and prints a table. Pure Python; seconds. Usage: ``python bench/hosttier_replay.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from libs.sim import trace as T  # noqa: E402
from libs.sim.profile import load_profile  # noqa: E402
from libs.sim.settings import SETTINGS, solo_latency, workflow_bytes  # noqa: E402

FRACTIONS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


class Cache:
    """Model weights in host memory under a byte budget, LRU or LFU."""

    def __init__(self, capacity: int, policy: str) -> None:
        self.capacity, self.policy = capacity, policy
        self.held: OrderedDict[str, int] = OrderedDict()  # model -> bytes, least recent first
        self.freq: dict[str, int] = {}
        self.used = 0

    def request(self, models: dict[str, int]) -> int:
        """Serve one request's models; returns the bytes read from external storage."""
        for m in models:
            self.freq[m] = self.freq.get(m, 0) + 1
            if m in self.held:
                self.held.move_to_end(m)
        missing = {m: b for m, b in models.items() if m not in self.held}
        for m, b in missing.items():
            if b > self.capacity:
                continue  # never fits: read from storage every time, not cached
            while self.used + b > self.capacity:
                victim = self._victim(set(models))
                if victim is None:
                    break
                self.used -= self.held.pop(victim)
            if self.used + b <= self.capacity:
                self.held[m] = b
                self.used += b
        return sum(missing.values())

    def _victim(self, pinned: set[str]) -> str | None:
        candidates = [m for m in self.held if m not in pinned]  # least recent first
        if not candidates:
            return None
        if self.policy == "lru":
            return candidates[0]
        return min(candidates, key=lambda m: self.freq[m])  # min keeps the least recent on ties


def replay(trace: list[T.Request], sizes: dict[str, dict[str, int]], capacity: int, policy: str, warmup: int):
    cache = Cache(capacity, policy)
    req_miss = n = 0
    bytes_miss = bytes_all = 0
    for i, r in enumerate(trace):
        models = sizes[r.workflow]
        missed = cache.request(models)
        if i < warmup:
            continue
        n += 1
        req_miss += missed > 0
        bytes_miss += missed
        bytes_all += sum(models.values())
    return {"requests": req_miss / n, "bytes": bytes_miss / bytes_all}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", default="s2", choices=sorted(SETTINGS))
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--cov", type=float, default=2.0)
    ap.add_argument("--zipf", type=float, default=T.DEFAULT_ZIPF_S)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "hosttier_replay")
    args = ap.parse_args()

    profile = load_profile("paper-s")
    specs = SETTINGS[args.setting]()
    solo = {s.name: solo_latency(s, profile).serial for s in specs}
    sizes = {s.name: workflow_bytes(s, profile) for s in specs}
    distinct: dict[str, int] = {m: b for per in sizes.values() for m, b in per.items()}
    total = sum(distinct.values())
    trace = T.generate(
        solo,
        rate=args.rate,
        duration_s=args.requests / args.rate,
        cov=args.cov,
        zipf_s=args.zipf,
        seed=args.seed,
    )

    rows = []
    for frac in FRACTIONS:
        cap = int(frac * total)
        row = {"fraction": frac, "capacity_gb": cap / 1e9}
        for policy in ("lru", "lfu"):
            row[policy] = replay(trace, sizes, cap, policy, args.warmup)
        rows.append(row)

    result = {
        "setting": args.setting,
        "profile": profile.name,
        "workflows": len(specs),
        "distinct_models": len(distinct),
        "distinct_model_gb": total / 1e9,
        "requests": len(trace),
        "warmup": args.warmup,
        "trace": {"rate": args.rate, "cov": args.cov, "zipf_s": args.zipf, "seed": args.seed},
        "miss_rate_definition": {
            "requests": "fraction of requests with at least one model not in host memory",
            "bytes": "bytes read from external storage / bytes of models requested",
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"), result)

    print(
        f"{args.setting}: {len(specs)} workflows, {len(distinct)} distinct models, {total / 1e9:.1f} GB; "
        f"{len(trace)} requests (Zipf s={args.zipf}, CoV {args.cov}), first {args.warmup} not counted"
    )
    print(f"{'capacity':>14} | {'LRU req':>8} {'LRU bytes':>9} | {'LFU req':>8} {'LFU bytes':>9}")
    for r in rows:
        print(
            f"{r['fraction']:4.0%} {r['capacity_gb']:7.1f} GB | {r['lru']['requests']:8.2%} {r['lru']['bytes']:9.2%} "
            f"| {r['lfu']['requests']:8.2%} {r['lfu']['bytes']:9.2%}"
        )
    return 0


def plot(rows: list[dict], out: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["fraction"] * 100 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, marker in (("lru", "o"), ("lfu", "s")):
        ax.plot(
            x, [r[policy]["requests"] * 100 for r in rows], marker=marker, label=f"{policy.upper()}, requests"
        )
        ax.plot(
            x,
            [r[policy]["bytes"] * 100 for r in rows],
            marker=marker,
            ls="--",
            label=f"{policy.upper()}, bytes",
        )
    ax.set_xlabel(f"host-memory capacity (% of {result['distinct_model_gb']:.0f} GB of distinct models)")
    ax.set_ylabel("miss rate (%)")
    ax.set_title(f"Host-tier replay, {result['setting'].upper()} (Zipf s={result['trace']['zipf_s']:g})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
