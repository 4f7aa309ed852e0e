"""A real-size model through the whole stack, under a weight budget below one copy of it.

Stable Diffusion 1.5 at its released configuration (the UNet, the VAE and the CLIP text encoder at
their published sizes, ~1.07 B parameters, 4.3 GB in fp32) with random weights, saved sharded in the
Hugging Face cache layout and registered by Hub id (``bench/sd15-realsize``, resolved offline), is
converted by the init job (``python -m libs.models.convert``, its peak memory measured) and served by
the real gateway, registry and scheduler and two executors whose weight budget
(``T2I_EXECUTOR_DEVICE_BUDGET_MB``, 3,500 MiB by default) is below one copy of the model (4,071 MiB)
but holds its largest component (the UNet, 3,281 MiB: a running model has all its layers on the
device, they are not streamed within a forward), so the UNet's layers are evicted for the text
encoder and the VAE and reloaded from the box's host tier during requests. Every image is compared bit for bit with the
monolithic ``StableDiffusionPipeline`` in the same dtype (fp32, one thread, as the executors run).

Printed: the conversion's peak RSS against the largest component and the whole model; loads per
tier (disk, host) with their bytes; reloads of evicted layers (``load_frac`` between 0 and 1, and
whole reloads of a model loaded before); each executor's peak cached weights against its budget,
its private memory and the host-tier blocks it maps, and the host tier's segments against the
tier's budget (sampled from ``/proc/<pid>/smaps`` and ``/dev/shm`` every 250 ms); and the
end-to-end ratio, stack over pipeline, cold (the first request vs ``from_pretrained`` + the first
call) and warm (the median of the later ones, requests one at a time).
The last line is ``realsize: OK ...`` or ``realsize: FAIL ...`` with those figures::

    .venv/bin/python bench/realsize.py [--steps 4] [--requests 4] [--budget-mb 3500]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, UNLIMITED_GATEWAY, bus_events, local_brokers, register, running

REPO_ID = "bench/sd15-realsize"
KEY = "sk-realsize"
PROMPT = "a lighthouse on a cliff at dusk"


def sd15_pipeline(seed: int) -> Any:
    """SD 1.5 at its released configuration with random weights (the tokenizer: the tiny families'
    in-memory one; the text encoder keeps CLIP's 49,408-token embedding)."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from libs.models.build_utils import clip_tokenizer

    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
            num_hidden_layers=12, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu",
            bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )
    )  # fmt: skip
    unet = UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=768, attention_head_dim=8,
    )  # fmt: skip
    vae = AutoencoderKL(
        sample_size=512, in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    )  # fmt: skip
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1,
    )  # fmt: skip
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=clip_tokenizer(), unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def build(work: Path, log: Any) -> tuple[Path, dict[str, int]]:
    """The model, saved sharded (200 MB shards) in the Hub cache layout under ``work/hub``; returns
    its snapshot and each component's bytes."""
    from libs.models.build_utils import save_in_hub_cache

    hub = work / "hub"
    marker = work / "built.json"
    if marker.is_file():
        info = json.loads(marker.read_text())
        return Path(info["snapshot"]), info["bytes"]
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()
    pipe = sd15_pipeline(seed=0)
    sizes = {
        name: sum(p.numel() * p.element_size() for p in getattr(pipe, name).parameters())
        for name in ("text_encoder", "unet", "vae")
    }
    plain = work / "saved"
    pipe.save_pretrained(plain, max_shard_size="200MB")
    del pipe
    snapshot = save_in_hub_cache(plain, REPO_ID, hub)
    shutil.rmtree(plain)
    marker.write_text(json.dumps({"snapshot": str(snapshot), "bytes": sizes}))
    log(f"built {REPO_ID} ({sum(sizes.values()) / 1e9:.2f} GB fp32) in {time.perf_counter() - t0:.0f}s")
    return snapshot, sizes


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[int, int, float]:
    """Run ``cmd``; (exit status, its peak RSS in bytes, seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode:
        print(err[-3000:], file=sys.stderr)
    return proc.returncode, usage.ru_maxrss * 1024, time.perf_counter() - t0


class Sampler:
    """Peaks, every 250 ms, of each executor's memory by kind (``/proc/<pid>/smaps``): its cached
    weights (on the CPU the weight cache's buffers are shared anonymous mappings, ``/dev/zero
    (deleted)``), its private memory (heap, torch's allocations: ``RssAnon``) and the host tier's
    blocks it maps; and of the host tier's segments in ``/dev/shm``."""

    def __init__(self, pids: dict[str, int], tier_prefix: str) -> None:
        self.pids = pids
        self.tier_prefix = tier_prefix
        self.weights = dict.fromkeys(pids, 0)
        self.private = dict.fromkeys(pids, 0)
        self.mapped_tier = dict.fromkeys(pids, 0)
        self.tier = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            try:
                smaps = Path(f"/proc/{pid}/smaps").read_text()
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            weights = tier = 0
            kind = ""
            for line in smaps.splitlines():
                if not line[:1].isupper():  # a mapping's header: "start-end perms offset dev inode path"
                    path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) > 5 else ""
                    kind = (
                        "weights"
                        if path == "/dev/zero (deleted)"
                        else "tier"
                        if f"/{self.tier_prefix}" in path
                        else ""
                    )
                elif kind and line.startswith("Rss:"):
                    kib = int(line.split()[1]) * 1024
                    if kind == "weights":
                        weights += kib
                    else:
                        tier += kib
            anon = next(
                (int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("RssAnon:")), 0
            )
            self.weights[name] = max(self.weights[name], weights)
            self.mapped_tier[name] = max(self.mapped_tier[name], tier)
            self.private[name] = max(self.private[name], anon)
        used = 0
        for entry in os.scandir("/dev/shm"):
            if entry.name.startswith(self.tier_prefix):
                try:
                    used += entry.stat().st_blocks * 512
                except OSError:
                    pass
        self.tier = max(self.tier, used)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self.sample()


async def generate(stack: Any, workflow: str, seed: int, steps: int) -> tuple[Any, float]:
    import numpy as np
    from PIL import Image

    t0 = time.perf_counter()
    status, body = await asyncio.to_thread(
        stack.http, "POST", "/v1/images/generations",
        {"model": workflow, "prompt": PROMPT, "seed": seed, "size": "64x64", "num_inference_steps": steps},
        KEY, 1800.0,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body}")
    png = base64.b64decode(body["data"][0]["b64_json"])
    return np.array(Image.open(io.BytesIO(png)).convert("RGB")), seconds


def reference(snapshot: Path, seeds: list[int], steps: int) -> tuple[dict[int, Any], float, float]:
    """The monolithic pipeline's images, the cold seconds (from_pretrained + the first call) and
    the median warm call."""
    import numpy as np
    import torch
    from diffusers import StableDiffusionPipeline

    torch.set_num_threads(1)  # the executors' thread count: the thread count changes the bits
    t0 = time.perf_counter()
    pipe = StableDiffusionPipeline.from_pretrained(snapshot)
    pipe.set_progress_bar_config(disable=True)
    images, warm = {}, []
    for seed in seeds:
        t1 = time.perf_counter()
        out = pipe(
            PROMPT, height=64, width=64, num_inference_steps=steps, guidance_scale=7.5,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        images[seed] = np.array(out.images[0])
        if seed == seeds[0]:
            cold = time.perf_counter() - t0
        else:
            warm.append(time.perf_counter() - t1)
    del pipe
    return images, cold, sorted(warm)[len(warm) // 2]


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=REPO / "var" / "bench" / "realsize")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--budget-mb", type=int, default=3500, help="each executor's weight budget")
    ap.add_argument("--host-tier-mb", type=int, default=6144)
    args = ap.parse_args()
    log = lambda msg: print(f"[realsize] {msg}", flush=True)  # noqa: E731
    from libs.launcher.stack import Stack
    from libs.models.sd_workflows import sd_workflow
    from tests.conftest import free_port

    snapshot, sizes = build(args.workdir / "model", log)
    total = sum(sizes.values())
    ckpt_cache = args.workdir / "checkpoints"
    shutil.rmtree(ckpt_cache, ignore_errors=True)  # convert from scratch, and measure it
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(snapshot.parents[2]),
        "T2I_CHECKPOINT_CACHE": str(ckpt_cache),
    }  # fmt: skip
    rc, convert_rss, convert_s = run_measured(
        [sys.executable, "-m", "libs.models.convert", str(snapshot.parents[2]), "--device", "cpu"], env
    )
    if rc:
        print(f"realsize: FAIL the init job's conversion exited {rc}")
        return 1
    log(
        f"converted in {convert_s:.0f}s, peak RSS {convert_rss / 1e9:.2f} GB: "
        f"{convert_rss / max(sizes.values()):.2f}x the largest component, {convert_rss / total:.2f}x the model"
    )

    seeds = list(range(1, args.requests + 1))
    expected, pipe_cold, pipe_warm = reference(snapshot, seeds, args.steps)
    log(f"pipeline: cold {pipe_cold:.1f}s, warm {pipe_warm:.1f}s")

    namespace = "realsize" + uuid.uuid4().hex[:6]
    tier_name = f"{namespace}-tier"
    workflow = sd_workflow("realsize-sd15", REPO_ID, sizes=["64x64"], steps=args.steps)
    model_root = args.workdir / "volume"  # empty: the model comes from the Hub cache
    model_root.mkdir(parents=True, exist_ok=True)
    extra = {
        k: env[k] for k in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "T2I_CHECKPOINT_CACHE")
    } | {
        "T2I_EXECUTOR_DEVICE_BUDGET_MB": str(args.budget_mb),
        "T2I_EXECUTOR_HOST_TIER_MB": str(args.host_tier_mb),
        "T2I_EXECUTOR_HOST_TIER": tier_name,
        "T2I_EXECUTOR_NODE_TIMEOUT_S": "1800",
    }  # fmt: skip
    loads: list[tuple[str, str, str, float, int]] = []  # (executor, fn, tier, frac, disk bytes)

    def on_event(ev: Any) -> None:
        timing = getattr(ev, "timing", None)
        if timing is not None and timing.load_frac > 0:
            loads.append((ev.executor, ev.node_id, timing.load_tier, timing.load_frac, timing.load_bytes))

    stack = Stack(
        namespace=namespace, log_dir=args.workdir / "logs", model_root=model_root, gateway_port=free_port(),
        executors=2, api_keys=f"{KEY}=bench:admin", gateway_env=dict(UNLIMITED_GATEWAY), extra_env=extra,
    )  # fmt: skip
    failures: list[str] = []
    with local_brokers():
        async with running(stack), bus_events(stack, on_event):
            await register(stack, [workflow], KEY)
            pids = {n: p.pid for n, p in stack.procs.items() if n.startswith("executor")}
            with Sampler(pids, f"t2i-hosttier-{tier_name}.") as sampler:
                times: dict[int, float] = {}
                got: dict[int, Any] = {}
                for seed in seeds:  # one at a time: the end-to-end ratio compares like with like
                    got[seed], times[seed] = await generate(stack, workflow.name, seed, args.steps)
            for s in seeds:
                if not (got[s].shape == expected[s].shape and (got[s] == expected[s]).all()):
                    failures.append(f"seed {s}: the image differs from the pipeline's")
    import numpy as np

    flat = [s for s in seeds if np.unique(got[s]).size <= 10]
    if flat:
        failures.append(f"flat images for seeds {flat}: the comparison would mean nothing")
    by_tier: dict[str, list[int]] = {}
    for _, _, tier, _, nbytes in loads:
        by_tier.setdefault(tier or "?", []).append(nbytes)
    partial = sum(1 for *_, frac, _ in loads if 0 < frac < 1)
    seen: set[tuple[str, str]] = set()
    whole_again = 0
    for ex, node, _, frac, _ in loads:
        fn = node.split("@")[0]
        if (ex, fn) in seen and frac >= 1:
            whole_again += 1
        seen.add((ex, fn))
    reloads = partial + whole_again
    if reloads == 0:
        failures.append("no layer was evicted and reloaded: the budget did not bind")
    budget = args.budget_mb << 20
    over = {n: sampler.weights[n] for n in pids if sampler.weights[n] > budget}
    if over:
        failures.append(f"cached weights over the {args.budget_mb} MiB budget: {over}")
    if sampler.tier > args.host_tier_mb << 20:
        failures.append(f"host tier {sampler.tier} bytes over its {args.host_tier_mb} MiB budget")
    if args.budget_mb << 20 >= total:
        failures.append("the weight budget is not below one copy of the model")
    if args.budget_mb << 20 < max(sizes.values()):
        # A running model has every layer on the device (layers are not streamed within a forward),
        # so a budget below the largest component cannot hold while it runs.
        failures.append("the weight budget is below the largest component (the UNet): it cannot hold")
    stack_cold = times[seeds[0]]
    stack_warm = sorted(times[s] for s in seeds[1:])[len(seeds[1:]) // 2] if len(seeds) > 1 else stack_cold
    tiers = ", ".join(
        f"{t}: {len(b)} loads, {sum(b) / 1e9:.2f} GB from disk" for t, b in sorted(by_tier.items())
    )
    log(f"loads by tier: {tiers}")
    for n in pids:
        log(
            f"{n}: peak cached weights {sampler.weights[n] / 1e9:.2f} GB (budget {budget / 1e9:.2f} GB), "
            f"private {sampler.private[n] / 1e9:.2f} GB, host-tier blocks mapped {sampler.mapped_tier[n] / 1e9:.2f} GB"
        )
    log(f"host tier: peak {sampler.tier / 1e9:.2f} GB of {args.host_tier_mb / 1024:.1f} GiB")
    log(f"reloads of evicted layers: {partial} partial, {whole_again} whole")
    figures = (
        f"bitwise={'yes' if not any('differs' in f for f in failures) else 'no'} model={total / 1e9:.2f}GB "
        f"budget={args.budget_mb}MiB/executor reloads={reloads} loads[{tiers}] "
        f"convert_peak_rss={convert_rss / 1e9:.2f}GB ({convert_rss / max(sizes.values()):.2f}x largest component) "
        f"executor_peak_weights={max(sampler.weights.values()) / 1e9:.2f}GB "
        f"executor_peak_private={max(sampler.private.values()) / 1e9:.2f}GB host_tier_peak={sampler.tier / 1e9:.2f}GB "
        f"e2e_ratio cold={stack_cold / pipe_cold:.2f} warm={stack_warm / pipe_warm:.2f} "
        f"(stack {stack_cold:.1f}s/{stack_warm:.1f}s vs pipeline {pipe_cold:.1f}s/{pipe_warm:.1f}s)"
    )
    if failures:
        print("realsize: FAIL " + "; ".join(failures) + " | " + figures)
        return 1
    print("realsize: OK " + figures)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
