"""End-to-end SLO attainment (ServerlessT2I, arXiv 2607.26566, §8.2, Fig. 10/11) on simulated H800s.

For setting S1 and/or S2 (``libs/sim/settings.py``) and each deployment mode (ours, nocache,
wcache, mcache: ``T2I_SCHEDULER_DEPLOYMENT``), the real gateway, registry and scheduler (policy
``fair``) run as processes over N simulated executors of profile ``paper-s`` (80 GB H800s: the
profile's GPU memory is the budget for cached weights). A trace from ``libs/sim/trace.py`` (Zipf
workflow popularity, Gamma arrivals, several tenants) is replayed through the gateway in real time
scaled by ``--time-scale``; the client measures each request's end-to-end latency and converts it
to profile time (wall / scale). A request meets its SLO when it succeeds within
``SLO scale x its workflow's solo (serial) latency``.

Four sweeps, each varying one factor around the defaults (``DEFAULTS``, docs/evaluation.md):
(a) rate scale, (b) SLO scale, (c) GPUs, (d) CoV scale. The SLO sweep re-judges the default run's
latencies against other deadlines (the scheduler never sees deadlines, so the run is the same).
Per point and mode it also reports where model loads were served from, per (request, model): the
model was resident on the GPU (no load), a prefix of its layers was resident (partial load), or a
full load from host memory (or disk); "accelerated" = not a full load (the paper's 99%/86%), and
the GPU memory held by cached weights (the heartbeats' ``cached`` bytes, averaged over the run).

One stack serves every point of a (setting, mode, GPU count); each point replays a fresh trace, its
first ``warm`` seconds not measured, and waits until the system is drained (a point that cannot
drain in time restarts the stack). Writes ``bench/results/slo_{s1,s2}_{rate,slo,gpus,cov}.png`` and
``slo.json``, and prints a table. ``--quick``: fewer points and shorter traces (12.5 min on 2 shared cores).
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

from common import REPO, bus_events, client_session, generate, local_brokers, register, running, sim_stack

from libs.protocol.messages import ExecutorHeartbeat, NodeComplete
from libs.sim import trace as tracegen
from libs.sim.profile import load_profile
from libs.sim.settings import PROFILE, SETTINGS, _dag, solo_latencies, workflow_bytes

MODES = ("ours", "nocache", "wcache", "mcache")
SWEEPS = ("rate", "slo", "gpus", "cov")
TIERS = ("gpu", "partial", "host", "disk")  # resident / prefix resident / full load from host / disk
TENANTS = 8
ADMIN = "sk-ops"

# Defaults per setting: GPUs, and the offered load at rate scale 1 (the mean arrival rate is
# load x GPUs / the Zipf-weighted mean solo latency: load 0.9 keeps GPUs 90% busy with pure compute).
DEFAULTS = {"s1": {"gpus": 8, "load": 0.9}, "s2": {"gpus": 8, "load": 0.9}}
DEFAULT_FACTORS = {"rate": 1.0, "slo": 3.0, "cov": 1.0}
POINTS = {
    "quick": {
        "rate": [0.75, 1.0, 1.25],
        "slo": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
        "gpus": [6, 8, 12],
        "cov": [1.0, 3.0],
    },
    "full": {
        "rate": [0.5, 0.75, 1.0, 1.25, 1.5, 1.75],
        "slo": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0],
        "gpus": [4, 6, 8, 10, 12, 16],
        "cov": [1.0, 2.0, 3.0, 4.0, 5.0],
    },
}
LABEL = {"rate": "rate scale", "slo": "SLO scale", "gpus": "number of GPUs", "cov": "CoV scale"}
NAMES = {"ours": "ServerlessT2I", "nocache": "NoCache", "wcache": "WCache", "mcache": "MCache"}


@dataclass
class Run:
    """What one replay measured."""

    latency: dict[str, float | None] = field(default_factory=dict)  # generation id -> profile s
    workflow: dict[str, str] = field(default_factory=dict)  # generation id -> workflow
    solo: dict[str, float] = field(default_factory=dict)  # generation id -> solo latency (s)
    tiers: dict[tuple[str, str], str] = field(default_factory=dict)  # (generation, model) -> tier
    node_tiers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    mem: list[int] = field(default_factory=list)  # cached bytes per heartbeat in the window
    wall_s: float = 0.0
    dirty: bool = False  # requests were still in flight when the point gave up on them


class Setting:
    """A setting's workflows, their solo latencies, models and defaults."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.specs = SETTINGS[name]()
        self.profile = load_profile(PROFILE)
        self.solo = {w: s.serial for w, s in solo_latencies(self.specs, self.profile).items()}
        self.sizes = {m: b for s in self.specs for m, b in workflow_bytes(s, self.profile).items()}
        self.model_of = {
            s.name: {nid.split("@")[0]: n.model for nid, n in _dag(s).nodes.items()} for s in self.specs
        }
        w = tracegen.zipf_weights(len(self.solo), tracegen.DEFAULT_ZIPF_S)
        self.mean_solo = float(sum(wi * s for wi, s in zip(w, self.solo.values(), strict=True)))
        self.gpus = DEFAULTS[name]["gpus"]
        self.rate = DEFAULTS[name]["load"] * self.gpus / self.mean_solo  # req/s at rate scale 1


def tier_of(load_s: float, frac: float, tier: str) -> str:
    if tier == "disk":
        return "disk"
    if frac >= 0.999 or (load_s > 0 and frac <= 0.0):
        return "host"
    return "partial" if frac > 0 else "gpu"


async def replay(
    stack, st: Setting, trace: list, scale: float, warm_s: float, seed: int, max_slo: float
) -> Run:
    """Post ``trace`` through the gateway in scaled real time; wait until every request ended."""
    run = Run()
    nodes: list[tuple[str, str, str]] = []  # (generation id, node id, tier) of every completion
    window = [False]

    def on_event(ev) -> None:
        if isinstance(ev, NodeComplete):
            t = tier_of(ev.timing.load_s, ev.timing.load_frac, ev.timing.load_tier)
            nodes.append((ev.request_id.rsplit("-", 1)[0], ev.node_id.split("@")[0], t))
        elif isinstance(ev, ExecutorHeartbeat) and window[0]:
            run.mem.append(sum(v[2] for v in ev.cached.values() if len(v) == 4))

    async def one(http, i: int, r) -> None:
        status, waited, body = await generate(http, stack, r.workflow, f"sk-{r.tenant}", seed + i)
        gen = body.get("id") or f"failed-{i}"
        if r.t >= warm_s:
            run.latency[gen] = waited / scale if status == 200 else None
            run.workflow[gen], run.solo[gen] = r.workflow, r.deadline_s

    t0 = time.monotonic()
    async with bus_events(stack, on_event), client_session() as http:
        tasks = []
        for i, r in enumerate(trace):
            await asyncio.sleep(max(0.0, t0 + r.t * scale - time.monotonic()))
            window[0] = r.t >= warm_s
            tasks.append(asyncio.create_task(one(http, i, r)))
        # Drained, or given up once the longest deadline the SLO sweep judges by has passed.
        _, pending = await asyncio.wait(tasks, timeout=max(st.solo.values()) * max_slo * scale + 10)
        window[0] = False
        if pending:
            run.dirty = True
            for t in pending:
                t.cancel()
        await asyncio.sleep(0.3)  # the last completions on the bus
    rank = {t: i for i, t in enumerate(TIERS)}
    for gen, comp, t in nodes:  # generation ids are known once the responses are in
        wf = run.workflow.get(gen)
        model = st.model_of[wf].get(comp, "") if wf else ""
        if not st.sizes.get(model):
            continue  # a warm-up request, or no weights (prepare)
        run.node_tiers[t] += 1
        old = run.tiers.get((gen, model))
        if old is None or rank[t] > rank[old]:
            run.tiers[(gen, model)] = t
    run.wall_s = time.monotonic() - t0
    return run


def summarise(run: Run, st: Setting, slo_scale: float) -> dict:
    n = len(run.latency)
    met = sum(1 for g, x in run.latency.items() if x is not None and x <= slo_scale * run.solo[g])
    ok = sum(1 for x in run.latency.values() if x is not None)
    counts = dict.fromkeys(TIERS, 0)
    for t in run.tiers.values():
        counts[t] += 1
    loads = sum(counts.values())
    gb = st.profile.gpu_memory_gb.value
    per_wf: dict[str, list[int]] = {}
    for g, x in run.latency.items():
        c = per_wf.setdefault(run.workflow[g], [0, 0])
        c[0] += x is not None and x <= slo_scale * run.solo[g]
        c[1] += 1
    mem = sum(run.mem) / len(run.mem) / 1e9 if run.mem else 0.0
    return {
        "requests": n,
        "succeeded": ok,
        "attainment": met / n if n else 0.0,
        "tiers": {t: (counts[t] / loads if loads else 0.0) for t in TIERS},
        "accelerated": (counts["gpu"] + counts["partial"]) / loads if loads else 0.0,
        "model_loads": loads,
        "node_tiers": dict(run.node_tiers),
        "gpu_mem_gb": mem,
        "gpu_mem_frac": mem / gb if gb else 0.0,
        "per_workflow": {w: c[0] / c[1] for w, c in sorted(per_wf.items())},
        "p50_slowdown": _median([x / run.solo[g] for g, x in run.latency.items() if x is not None]),
        "wall_s": run.wall_s,
        "slowdowns": sorted(
            (run.workflow[g], round(x / run.solo[g], 2) if x is not None else None)
            for g, x in run.latency.items()
        ),
    }


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def make_trace(st: Setting, args, rate_scale: float, cov_scale: float, seed: int, warm: float) -> list:
    solo = st.solo  # deadline_s = 1 x solo; SLO scales apply when judging
    dur = warm + args.duration
    return tracegen.generate(
        solo, rate=st.rate, duration_s=dur, rate_scale=rate_scale, cov_scale=cov_scale, slo_scale=1.0,
        tenants=TENANTS, seed=seed,
    )  # fmt: skip


async def run_mode(st: Setting, mode: str, args, sweeps: list[str], pts: dict, urls) -> list[dict]:
    """Every point of ``sweeps`` for one (setting, mode); one stack per GPU count."""
    keys = ",".join([f"{ADMIN}=ops:admin"] + [f"sk-t{j:02d}=t{j:02d}" for j in range(TENANTS)])
    plan: dict[int, list[tuple[str, float, float]]] = {}  # gpus -> (sweep, rate scale, cov scale)
    if {"rate", "slo", "cov"} & set(sweeps) or "gpus" in sweeps:
        plan[st.gpus] = [("default", 1.0, 1.0)]
    if "rate" in sweeps:
        plan[st.gpus] += [("rate", x, 1.0) for x in pts["rate"] if x != 1.0]
    if "cov" in sweeps:
        plan[st.gpus] += [("cov", 1.0, x) for x in pts["cov"] if x != 1.0]
    if "gpus" in sweeps:
        for g in pts["gpus"]:
            plan.setdefault(g, [("gpus", 1.0, 1.0)])
    out = []
    for gpus, points in plan.items():
        i = 0
        while i < len(points):
            stack = sim_stack(
                f"slo{st.name}{mode[:2]}",
                REPO / "var" / "bench" / f"slo-{st.name}-{mode}-{gpus}",
                gpus=gpus,
                profile=PROFILE,
                time_scale=args.time_scale,
                api_keys=keys,
                nats_url=urls[0],
                redis_url=urls[1],
                scheduler_env={"T2I_SCHEDULER_POLICY": "fair", "T2I_SCHEDULER_DEPLOYMENT": mode},
                # every mode shares the box's host tier (256 GB: every model of S2 fits); simulated
                # executors model it as every load reading pinned host memory at the profile's rate
                extra_env={"T2I_EXECUTOR_HOST_TIER_MB": "262144"},
            )
            async with running(stack):
                await register(stack, st.specs, ADMIN)
                fresh = True
                while i < len(points):
                    kind, rs, cs = points[i]
                    i += 1
                    warm = args.warm * (2 if fresh else 1)  # a fresh stack starts cold: warm it longer
                    fresh = False
                    trace = make_trace(st, args, rs, cs, args.seed, warm)
                    run = await replay(stack, st, trace, args.time_scale, warm, 1000 * i, max(pts["slo"]))
                    for sweep, x in point_sweeps(kind, rs, cs, gpus, st, sweeps, pts):
                        rec = summarise(run, st, x if sweep == "slo" else DEFAULT_FACTORS["slo"])
                        out.append({"setting": st.name, "mode": mode, "sweep": sweep, "x": x, "gpus": gpus,
                                    "rate_scale": rs, "cov_scale": cs, **rec})  # fmt: skip
                    d = summarise(run, st, DEFAULT_FACTORS["slo"])
                    print(
                        f"  {st.name} {mode:8s} gpus={gpus:<3d} rate×{rs:<4g} cov×{cs:<3g}: {d['requests']:3d} req,"
                        f" SLO {100 * d['attainment']:5.1f}%, accel {100 * d['accelerated']:5.1f}%,"
                        f" mem {d['gpu_mem_gb']:5.1f} GB, {run.wall_s:.0f}s{' (restart)' if run.dirty else ''}",
                        file=sys.stderr,
                        flush=True,
                    )
                    if run.dirty:
                        break  # work still in flight: a fresh stack for the next point
    return out


def point_sweeps(kind, rs, cs, gpus, st: Setting, sweeps, pts) -> list[tuple[str, float]]:
    """The (sweep, x) points one run stands for."""
    if kind != "default":
        return [(kind, {"rate": rs, "cov": cs, "gpus": gpus}[kind])]
    out = []
    if "rate" in sweeps:
        out.append(("rate", 1.0))
    if "cov" in sweeps:
        out.append(("cov", 1.0))
    if "gpus" in sweeps and gpus in pts["gpus"]:
        out.append(("gpus", gpus))
    if "slo" in sweeps:
        out += [("slo", x) for x in pts["slo"]]
    return out


def plot(points: list[dict], setting: str, sweep: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    for mode in MODES:
        ps = sorted((p["x"], 100 * p["attainment"]) for p in points if p["mode"] == mode)
        if ps:
            ax.plot(*zip(*ps, strict=True), marker="o", label=NAMES[mode])
    ax.axhline(90, color="grey", ls="--", lw=0.8)
    ax.set_xlabel(LABEL[sweep])
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{setting.upper()}: SLO attainment vs {LABEL[sweep]}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"slo_{setting}_{sweep}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def threshold(points: list[dict], mode: str, sweep: str) -> str:
    ps = sorted((p["x"], p["attainment"]) for p in points if p["mode"] == mode and p["sweep"] == sweep)
    if not ps:
        return "-"
    if sweep == "rate":  # the first rate scale below 90%
        below = [x for x, a in ps if a < 0.9]
        return f"{below[0]:g}" if below else f">{ps[-1][0]:g}"
    ok = [x for x, a in ps if a >= 0.9]  # the fewest GPUs (or the tightest SLO scale) reaching 90%
    return f"{ok[0]:g}" if ok else f">{ps[-1][0]:g}"


def report(points: list[dict], settings: list[str], sweeps: list[str], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "slo.json").write_text(json.dumps({**meta, "points": points}, indent=1))
    for s in settings:
        for sw in sweeps:
            ps = [p for p in points if p["setting"] == s and p["sweep"] == sw]
            if ps:
                print(f"plot: {plot(ps, s, sw, out)}")
    for s in settings:
        for sw in sweeps:
            ps = [p for p in points if p["setting"] == s and p["sweep"] == sw]
            xs = sorted({p["x"] for p in ps})
            if not xs:
                continue
            print(f"\n{s.upper()} SLO attainment (%) vs {LABEL[sw]}")
            print(f"{'mode':15s}" + "".join(f"{x:>7g}" for x in xs) + "   accel%   gpu%  GPU GB")
            for mode in MODES:
                by = {p["x"]: p for p in ps if p["mode"] == mode}
                if not by:
                    continue
                cells = "".join(f"{100 * by[x]['attainment']:7.0f}" if x in by else f"{'-':>7s}" for x in xs)
                acc = sum(p["accelerated"] for p in by.values()) / len(by)
                gpu = sum(p["tiers"]["gpu"] for p in by.values()) / len(by)
                mem = sum(p["gpu_mem_gb"] for p in by.values()) / len(by)
                print(f"{NAMES[mode]:15s}{cells}{100 * acc:9.1f}{100 * gpu:7.1f}{mem:8.1f}")
    print(
        "\naccel%: model loads (per request and model) not needing a full load (resident or a resident prefix);"
    )
    print(
        "gpu%: resident, no load at all; GPU GB: cached weights per GPU, mean over heartbeats (budget 80 GB)"
    )
    for s in settings:
        ps = [p for p in points if p["setting"] == s]
        if not ps:
            continue
        print(f"\n{s.upper()} summary   {'<90% at rate×':>14s}{'GPUs for 90%':>14s}{'SLO× for 90%':>14s}"
              f"{'accel loads':>13s}{'full loads':>12s}")  # fmt: skip
        for mode in MODES:
            dp = [p for p in ps if p["mode"] == mode and p["rate_scale"] == 1.0 and p["cov_scale"] == 1.0]
            dp = [p for p in dp if p["gpus"] == DEFAULTS[s]["gpus"]]
            if not dp:
                continue
            d = dp[0]
            print(
                f"{NAMES[mode]:18s}{threshold(ps, mode, 'rate'):>14s}{threshold(ps, mode, 'gpus'):>14s}"
                f"{threshold(ps, mode, 'slo'):>14s}{100 * d['accelerated']:12.1f}%"
                f"{100 * (d['tiers']['host'] + d['tiers']['disk']):11.1f}%"
            )


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer points, short traces (~13 min)")
    ap.add_argument("--setting", choices=["s1", "s2", "both"], default="both")
    ap.add_argument("--sweep", default=",".join(SWEEPS), help="comma-separated: rate,slo,gpus,cov")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--time-scale", type=float, default=None, help="wall s per profile s")
    ap.add_argument("--duration", type=float, default=None, help="measured profile seconds per point")
    ap.add_argument("--warm", type=float, default=None, help="unmeasured profile seconds first")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    q = args.quick
    args.time_scale = args.time_scale or (0.15 if q else 0.25)
    args.duration = args.duration if args.duration is not None else (40.0 if q else 300.0)
    args.warm = args.warm if args.warm is not None else (15.0 if q else 60.0)
    sweeps = [s for s in args.sweep.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    if bad := (set(sweeps) - set(SWEEPS)) | (set(modes) - set(MODES)):
        ap.error(f"unknown sweeps/modes {sorted(bad)}")
    settings = ["s1", "s2"] if args.setting == "both" else [args.setting]
    pts = POINTS["quick" if q else "full"]
    t0 = time.monotonic()
    points: list[dict] = []
    with local_brokers() as urls:
        for s in settings:
            st = Setting(s)
            print(f"{s}: {len(st.specs)} workflows, {st.gpus} GPUs, {st.rate:.3f} req/s at rate scale 1"
                  f" (mean solo {st.mean_solo:.2f}s)", file=sys.stderr)  # fmt: skip
            for mode in modes:
                points += await run_mode(st, mode, args, sweeps, pts, urls)
    wall = time.monotonic() - t0
    meta = {
        "quick": q,
        "time_scale": args.time_scale,
        "duration_s": args.duration,
        "warm_s": args.warm,
        "tenants": TENANTS,
        "defaults": {s: {**DEFAULTS[s], "rate": Setting(s).rate} for s in settings}
        | {"factors": DEFAULT_FACTORS},
        "wall_s": wall,
    }
    report(points, settings, sweeps, Path(args.out), meta)
    print(f"\nwall time {wall:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
