"""Fairness experiments (paper §6: Fig. 9-right and Fig. 13-right) on simulated executors.

Two tenants, one sending SD3-medium-like requests and one Flux1-dev-like requests (10x the solo
latency), each at 2 requests/s, on 4 simulated H800s (``libs/sim/profiles/paper-h800.json``). Each
tenant also starts with a backlog so both are backlogged from the start. The real gateway,
registry and scheduler run as processes; only the executors are simulated. For every policy:

* the difference in cumulative service (measured GPU seconds) between the tenants over the interval
  in which both remain backlogged (both have ready work waiting), as in Fig. 9-right, and
  the same in vTime, which is what the bound 2(Δ + L_max) of §6 speaks about;
* SLO attainment: requests finished within 3x their workflow's solo latency (Fig. 13-right).

Policies: FIFO, SJF, VTC (operation counts) and ours (Algorithm 1) with Δ in {0, 5, 10, 20} s.
Times are profiled GPU seconds; ``--scale`` replays them faster than real time (0.25: a 60 s run
takes 15 s). Writes ``bench/results/fairness_gap.png``, ``fairness_slack.png`` and
``fairness.json``, and prints a table. Usage: ``python bench/fairness.py [--duration 60]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, client_session, generate, local_brokers, register, running, sim_stack
from redis.asyncio import Redis

from libs.protocol.keys import Keys
from libs.sim.profile import load_profile
from libs.sim.workflows import flux1_dev_like, sd3_medium_like

TENANTS = {"sd3": "sd3-medium-like", "flux": "flux1-dev-like"}
FAMILY = {"sd3": "sd3-medium", "flux": "flux1-dev"}
CONFIGS = [
    ("fifo", 0.0),
    ("sjf", 0.0),
    ("vtc", 0.0),
    ("fair", 0.0),
    ("fair", 5.0),
    ("fair", 10.0),
    ("fair", 20.0),
]
STEPS = 28


@dataclass
class Run:
    policy: str
    slack: float
    samples: list[tuple[float, dict]] = field(default_factory=list)  # (profile seconds, tenant view)
    latency: dict[str, list[float | None]] = field(default_factory=lambda: {t: [] for t in TENANTS})

    @property
    def label(self) -> str:
        return f"ours Δ={self.slack:g}s" if self.policy == "fair" else self.policy.upper()


def solo_latency(profile, family: str) -> float:
    m = profile.models
    return (
        sum(m[f"{family}/{p}"].exec_s.value for p in ("text", "prepare", "vae"))
        + STEPS * m[f"{family}/dit"].exec_s.value
    )


async def run_config(
    policy: str, slack: float, args, nats_url: str, redis_url: str, deadlines: dict[str, float]
) -> Run:
    scale = args.scale
    stack = sim_stack(
        "fair",
        REPO / "var" / "bench" / f"fair-{policy}-{slack:g}",
        gpus=args.gpus,
        profile="paper-h800",
        time_scale=scale,
        api_keys="sk-warmup=warmup:admin,sk-sd3=sd3,sk-flux=flux",
        nats_url=nats_url,
        redis_url=redis_url,
        scheduler_env={
            "T2I_SCHEDULER_POLICY": policy,
            "T2I_SCHEDULER_SLACK_S": str(slack),
            "T2I_SCHEDULER_VIEW_S": "0.05",
        },
    )
    run = Run(policy, slack)
    keys = Keys(stack.namespace)
    async with running(stack):
        redis = Redis.from_url(redis_url)
        try:
            await register(stack, (sd3_medium_like(), flux1_dev_like()), "sk-warmup")
            async with client_session() as http:

                async def one(tenant: str, seed: int, key: str = "") -> float | None:
                    status, waited, _ = await generate(
                        http, stack, TENANTS[tenant], key or "sk-" + tenant, seed
                    )
                    return waited / scale if status == 200 else None

                # Warm-up by a third tenant: models resident, estimates learnt; the two measured tenants
                # start with no history, so neither begins the run ahead in vTime.
                for tenant in TENANTS:
                    assert await one(tenant, 0, key="sk-warmup") is not None
                start = time.monotonic()
                stop_sampling = asyncio.Event()

                async def sample() -> None:
                    while not stop_sampling.is_set():
                        view = {
                            k.decode(): json.loads(v) for k, v in (await redis.hgetall(keys.tenants)).items()
                        }
                        run.samples.append(((time.monotonic() - start) / scale, view))
                        await asyncio.sleep(0.05)

                sampler = asyncio.create_task(sample())
                tasks: dict[str, list[asyncio.Task]] = {t: [] for t in TENANTS}
                seed = 1
                for tenant in TENANTS:
                    for _ in range(args.backlog):
                        tasks[tenant].append(asyncio.create_task(one(tenant, seed)))
                        seed += 1
                interval = 1.0 / args.rate
                for k in range(int(args.duration * args.rate)):  # 2 requests/s each, in profile time
                    await asyncio.sleep(max(0.0, start + k * interval * scale - time.monotonic()))
                    for tenant in TENANTS:
                        tasks[tenant].append(asyncio.create_task(one(tenant, seed)))
                        seed += 1
                # Wait long enough for every request to meet or miss its deadline, then stop.
                await asyncio.sleep(max(deadlines.values()) * scale)
                stop_sampling.set()
                await sampler
                for tenant, ts in tasks.items():
                    for t in ts:
                        run.latency[tenant].append(t.result() if t.done() and not t.exception() else None)
                        t.cancel()
        finally:
            await redis.aclose()
    return run


def analyse(run: Run, deadlines: dict[str, float]) -> dict:
    # Eligible-backlogged (paper §6): has ready work waiting. The interval is the first contiguous
    # stretch of samples in which both are; it ends when one of them drains.
    window: list[tuple[float, dict]] = []
    for t, v in run.samples:
        if v.get("sd3", {}).get("ready_nodes", 0) > 0 and v.get("flux", {}).get("ready_nodes", 0) > 0:
            window.append((t, v))
        elif window:
            window.append((t, v))  # v(t2): the state at the instant the interval ends
            break
    both = [(t, v["flux"]["service_s"] - v["sd3"]["service_s"]) for t, v in window]
    gap = [d for _, d in both]
    vgap = [v["flux"]["vtime_s"] - v["sd3"]["vtime_s"] for _, v in window]
    slo = {}
    for tenant, lat in run.latency.items():
        met = sum(1 for x in lat if x is not None and x <= deadlines[tenant])
        slo[tenant] = met / len(lat) if lat else 0.0
    total = sum(len(v) for v in run.latency.values())
    met_all = sum(1 for t, lat in run.latency.items() for x in lat if x is not None and x <= deadlines[t])
    end = run.samples[-1][1] if run.samples else {}
    return {
        "policy": run.policy,
        "slack_s": run.slack,
        "label": run.label,
        "backlogged_s": (both[-1][0] - both[0][0]) if both else 0.0,
        "max_gap_s": (max(gap) - min(gap)) if gap else 0.0,
        "max_vtime_gap_s": (max(vgap) - min(vgap)) if vgap else 0.0,
        "series": [(t - both[0][0], d - both[0][1]) for t, d in both] if both else [],
        "slo": slo,
        "slo_all": met_all / total if total else 0.0,
        "service_s": {t: end.get(t, {}).get("service_s", 0.0) for t in TENANTS},
        "requests": {t: len(v) for t, v in run.latency.items()},
    }


def plot(results: list[dict], out: Path, l_max: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r["policy"] != "fair" or r["slack_s"] == 5.0:
            xs, ys = zip(*r["series"], strict=True) if r["series"] else ((), ())
            ax.plot(xs, ys, label=r["label"])
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("time while both tenants are backlogged (s, simulated H800s)")
    ax.set_ylabel("service difference, Flux1-dev − SD3-medium (GPU s)")
    ax.set_title("Fig. 9-right: two tenants at 2 req/s each on 4 GPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fairness_gap.png", dpi=120)

    ours = [r for r in results if r["policy"] == "fair"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in ours:
        xs, ys = zip(*r["series"], strict=True) if r["series"] else ((), ())
        (line,) = left.plot(xs, ys, label=r["label"])
        bound = 2 * (r["slack_s"] + l_max)
        left.axhline(bound, color=line.get_color(), ls=":", lw=0.8)
        left.axhline(-bound, color=line.get_color(), ls=":", lw=0.8)
    left.set_xlabel("time while both tenants are backlogged (s)")
    left.set_ylabel("service difference (GPU s); dotted: ±2(Δ+L_max)")
    left.legend()
    labels = [f"{r['slack_s']:g}" for r in ours]
    right.bar(labels, [100 * r["slo_all"] for r in ours], color="tab:blue")
    right.set_xlabel("slack Δ (s)")
    right.set_ylabel("SLO attainment (%), deadline 3x solo latency")
    right.set_ylim(0, 100)
    for i, r in enumerate(ours):
        right.text(i, 100 * r["slo_all"] + 1, f"{100 * r['slo_all']:.0f}%", ha="center")
    fig.suptitle("Fig. 13-right: our scheduler with varying slack")
    fig.tight_layout()
    fig.savefig(out / "fairness_slack.png", dpi=120)


def report(results: list[dict], args, profile, deadlines: dict[str, float], l_max: float) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fairness.json").write_text(
        json.dumps({"deadlines_s": deadlines, "l_max_s": l_max, "results": results}, indent=1)
    )
    plot(results, out, l_max)
    print(
        f"\n{args.gpus} simulated {profile.device}, 2 tenants x {args.rate:g} req/s for {args.duration:g}s"
        f" (+{args.backlog} queued each at t=0); deadlines: SD3 {deadlines['sd3']:.2f}s, Flux {deadlines['flux']:.1f}s;"
        f" L_max = {l_max:.3f}s"
    )
    hdr = (
        f"{'policy':16s}{'backlogged s':>13s}{'service gap':>12s}{'vTime gap':>10s}{'bound':>7s}"
        f"{'SLO sd3':>9s}{'SLO flux':>10s}{'SLO all':>9s}{'svc sd3':>9s}{'svc flux':>10s}"
    )
    print(hdr)
    for r in results:
        bound = f"{2 * (r['slack_s'] + l_max):7.2f}" if r["policy"] == "fair" else f"{'-':>7s}"
        print(
            f"{r['label']:16s}{r['backlogged_s']:13.1f}{r['max_gap_s']:12.2f}{r['max_vtime_gap_s']:10.2f}{bound}"
            f"{100 * r['slo']['sd3']:8.0f}%{100 * r['slo']['flux']:9.0f}%{100 * r['slo_all']:8.0f}%"
            f"{r['service_s']['sd3']:9.1f}{r['service_s']['flux']:10.1f}"
        )
    print("gaps: max over t1 < t2 in the backlogged interval of |W_flux - W_sd3|; bound: 2(Δ + L_max)")
    print(f"plots: {out / 'fairness_gap.png'}, {out / 'fairness_slack.png'}")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds (profile time) of arrivals")
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s per tenant")
    ap.add_argument("--backlog", type=int, default=20, help="requests per tenant queued at the start")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.25, help="real seconds per profiled second")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--only", default="", help="comma-separated labels to run, e.g. fifo,fair:5")
    args = ap.parse_args()

    profile = load_profile("paper-h800")
    deadlines = {t: 3 * solo_latency(profile, FAMILY[t]) for t in TENANTS}
    # The largest charge of a single dispatch: a cold load plus one call (Flux's DiT: 0.77 + 0.235 s).
    l_max = max(m.load_s.value + m.exec_s.value for m in profile.models.values())
    configs = CONFIGS
    if args.only:
        wanted = set(args.only.split(","))
        configs = [(p, s) for p, s in CONFIGS if p in wanted or f"{p}:{s:g}" in wanted]
    results = []
    with local_brokers() as (nats_url, redis_url):
        for policy, slack in configs:
            t0 = time.monotonic()
            run = await run_config(policy, slack, args, nats_url, redis_url, deadlines)
            results.append(analyse(run, deadlines))
            print(f"  {run.label}: done in {time.monotonic() - t0:.0f}s", file=sys.stderr)

    report(results, args, profile, deadlines, l_max)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
