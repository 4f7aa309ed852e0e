"""Layer-prefix caching: the shape of the paper's Fig. 12-left, on real CPU executors and on simulated
H800 executors.

The paper (ServerlessT2I, arXiv 2607.26566, §8.3, Fig. 12-left) breaks one Flux1-Schnell request
into loading and inference under five settings: ``w/o ppl.`` (every missing layer loads, then the
model runs), ``ppl.(0)`` (nothing resident, layer-wise pipelined loading), ``ppl.(Lₑ′/2)``,
``ppl.(Lₑ′)`` (the first Lₑ′ layers of each model resident: the rest hides behind their compute) and
``w/o load`` (everything resident). It reports, for ppl.(Lₑ′) against ppl.(0), −90% loading time and
−21% end to end, and −62% loading time for ppl.(Lₑ′/2).

* **CPU**: the ``bench`` Flux preset (a 71M-parameter DiT, 272 MiB in fp32) runs the
  ``bench-flux`` workflow (4 steps, 256x256) through an executor's model cache
  (:class:`services.executor.runtime.ModelCache`, the real weight cache and loader) with no host
  tier: missing layers come from disk, the checkpoint files dropped from the page cache before each
  request (``posix_fadvise(DONTNEED)``), the tier that is slow on this machine. Each model's Lₑ′ is
  the one the cache computed from the first load's per-layer profile. Before each request every
  model is trimmed to its prefix; "load" is the time the request spent on loading that compute did
  not hide (before each node's forward, plus its waits for layers inside it).
* **H800 (simulated)**: the same five settings for Flux1-Schnell (text encoders, DiT, VAE decoder;
  4 steps) from ``libs/sim/profiles/paper-h800.json`` through :class:`services.executor.sim.SimRunner`
  (the same cache policy; per-layer times from size and bandwidth), ``w/o ppl.`` from
  :func:`libs.dataplane.weights.sequential_seconds`.

Prints a table per platform and the reductions next to the paper's; writes
``bench/results/prefix.json`` and ``bench/results/prefix.png``.

    .venv/bin/python bench/prefix.py [--rounds 3] [--models models]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("w/o ppl.", "ppl.(0)", "ppl.(Le'/2)", "ppl.(Le')", "w/o load")
PAPER = {
    "load ppl.(Le') vs ppl.(0)": -90.0,
    "e2e ppl.(Le') vs ppl.(0)": -21.0,
    "load ppl.(Le'/2) vs ppl.(0)": -62.0,
}


def prefix_for(mode: str, keep: int, n: int) -> int:
    return {"w/o ppl.": 0, "ppl.(0)": 0, "ppl.(Le'/2)": keep // 2, "ppl.(Le')": keep, "w/o load": n}[mode]


# -- real CPU executors ----------------------------------------------------------------------------


def cpu(models: Path, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    from loading import drop_cache  # type: ignore[import-not-found]

    from libs.dataplane.loader import Loader
    from libs.models.flux_workflows import bench_flux
    from libs.models.tiny_flux import build_flux
    from libs.workflow.local import LocalRunner
    from services.executor.runtime import ModelCache

    torch.set_num_threads(1)  # as an executor runs
    build_flux(models / "bench-flux", "bench")
    spec = bench_flux()
    params = {"prompt": "a lighthouse at dusk", "seed": 3, "num_inference_steps": steps}

    class Recording(ModelCache):
        loads: list[float] = []

        def release(self, held: Any) -> Any:
            load = super().release(held)
            self.loads.append(load.seconds)
            return load

    out: dict[str, dict[str, float]] = {}
    with Loader() as loader:  # no host tier: missing layers are read from disk
        cache = Recording(models, "cpu", loader)
        runner = LocalRunner(models, models=cache)
        runner.run(spec, params)  # converts the checkpoints on the first run ever
        files = sorted((models / "bench-flux").glob("*/.t2i-ckpt/*/part-*.bin"))
        # The profile (hence Lₑ′) comes from the first load: from disk, as every reload below.
        cache = Recording(models, "cpu", loader)
        runner = LocalRunner(models, models=cache)
        drop_cache(files)
        reference = runner.run(spec, params)["image"]  # loads and profiles every model
        keys = list(cache.weights.models)
        for key in keys:
            vm = cache.weights.models[key]
            print(
                f"  {key}: {len(vm.slots)} layers, {vm.nbytes / 2**20:.1f} MiB, Le' = {cache.weights.policy.keep(key)}"
            )
        samples: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:  # rotate the order
                cache.weights.pipelined = mode != "w/o ppl."
                for key in keys:
                    n = len(cache.weights.models[key].slots)
                    cache.trim(key.fn, key.model, prefix_for(mode, cache.weights.policy.keep(key), n))
                drop_cache(files)
                cache.loads = []
                t0 = time.perf_counter()
                image = runner.run(spec, params)["image"]
                e2e = time.perf_counter() - t0
                assert torch.equal(image, reference), mode  # every setting, the same image
                samples[mode].append((e2e, sum(cache.loads)))
        cache.weights.pipelined = True
    for mode in MODES:
        e2e = statistics.median(s[0] for s in samples[mode])
        load = statistics.median(s[1] for s in samples[mode])
        out[mode] = {"e2e_s": e2e, "load_s": load, "inference_s": e2e - load}
    return out


# -- simulated H800 executors ----------------------------------------------------------------------


def h800(steps: int) -> dict[str, dict[str, float]]:
    from libs.dataplane.weights import sequential_seconds
    from libs.protocol.ids import ModelKey
    from libs.protocol.messages import Dispatch
    from libs.sim.profile import load_profile
    from services.executor.sim import SimRunner, SimStore

    profile = load_profile("paper-h800")
    nodes = ["flux1-dev/text"] + ["flux1-dev/dit"] * steps + ["flux1-dev/vae"]  # Flux1-Schnell: 4 steps
    fn = "sim.node"
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        runner = SimRunner(profile, SimStore("sim-0", 1 << 30), time_scale=1e-4)
        load = inference = 0.0
        seen: set[str] = set()
        for i, model in enumerate(nodes):
            key = ModelKey(fn, model)
            if model not in seen:  # the first call of each model: set its prefix, then run
                seen.add(model)
                asyncio.run(runner.run(Dispatch("warm", 1, f"w{i}", "t", fn, model, {}, [])))
                n = len(runner.policy.sizes(key))
                runner.policy.shrink(key, prefix_for(mode, runner.policy.keep(key), n))
            prof = profile.model(model)
            assert prof is not None
            loads, comps = runner._times[key]  # noqa: SLF001 - the per-layer times it simulates
            resident = runner.policy.resident(key)
            if mode == "w/o ppl.":
                exposed = sequential_seconds(loads, comps, resident) - sum(comps)
                asyncio.run(runner.run(Dispatch("r", 1, f"n{i}", "t", fn, model, {}, [])))
            else:
                timing = asyncio.run(runner.run(Dispatch("r", 1, f"n{i}", "t", fn, model, {}, []))).timing
                exposed = timing.load_s / timing.exec_s * prof.exec_s.value if timing.exec_s else 0.0
            load += exposed
            inference += prof.exec_s.value
        out[mode] = {"e2e_s": load + inference, "load_s": load, "inference_s": inference}
    return out


# -- report ----------------------------------------------------------------------------------------


def reductions(res: dict[str, dict[str, float]]) -> dict[str, float]:
    base, best, half = res["ppl.(0)"], res["ppl.(Le')"], res["ppl.(Le'/2)"]

    def pct(new: float, old: float) -> float:
        return 100.0 * (new - old) / old if old else 0.0

    return {
        "load ppl.(Le') vs ppl.(0)": pct(best["load_s"], base["load_s"]),
        "e2e ppl.(Le') vs ppl.(0)": pct(best["e2e_s"], base["e2e_s"]),
        "load ppl.(Le'/2) vs ppl.(0)": pct(half["load_s"], base["load_s"]),
    }


def table(name: str, res: dict[str, dict[str, float]]) -> None:
    print(f"\n{name}")
    print(f"  {'setting':<13} {'load s':>8} {'inference s':>12} {'end to end s':>13}")
    for mode in MODES:
        r = res[mode]
        print(f"  {mode:<13} {r['load_s']:>8.3f} {r['inference_s']:>12.3f} {r['e2e_s']:>13.3f}")
    for what, value in reductions(res).items():
        print(f"  {what}: {value:+.0f}% (paper {PAPER[what]:+.0f}%)")


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.6))
    for ax, (name, res) in zip(axes, results.items(), strict=True):
        loads = [res[m]["load_s"] for m in MODES]
        infer = [res[m]["inference_s"] for m in MODES]
        ax.bar(MODES, infer, label="inference", color="#4c72b0")
        ax.bar(MODES, loads, bottom=infer, label="loading (not hidden)", color="#dd8452")
        ax.set_title(name)
        ax.set_ylabel("seconds per request")
        ax.tick_params(axis="x", rotation=20)
        ax.legend(fontsize=8)
    fig.suptitle("Layer-prefix caching (paper Fig. 12-left's settings)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--models", default=str(REPO / "models"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("CPU executor, bench-flux (disk, page cache dropped):")
    results = {
        "CPU executor, bench-flux, disk": cpu(Path(args.models), args.rounds, args.steps),
        "simulated H800, Flux1-Schnell": h800(args.steps),
    }
    for name, res in results.items():
        table(name, res)
    (out / "prefix.json").write_text(
        json.dumps(
            {name: {"settings": res, "reductions_pct": reductions(res)} for name, res in results.items()},
            indent=2,
        )
    )
    plot(results, out / "prefix.png")
    print(f"\nwrote {out / 'prefix.json'} and {out / 'prefix.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
