"""Overhead of decomposition: the full stack (2 executors) against monolithic diffusers, same run.

Builds the ``bench`` Flux preset (a 71M-parameter DiT; one step at 256x256 takes well over 100 ms
on this CPU), starts gateway, registry, scheduler and two executors as separate processes, and
times the same generation both ways with the same components, seed and parameters:

* baseline: ``FluxPipeline.__call__`` in this process (1 thread, as each executor has), then the
  PNG encoding the API delivers (``encode_png``, the executor's own encoder: a monolithic server
  must encode its image too);
* decomposed: ``POST /v1/images/generations`` end to end (HTTP, NATS, Redis, data plane, PNG).

Method (2026-11-30): two untimed warm-ups of each; then ``--runs`` interleaved pairs (monolithic,
then decomposed), so drift in the machine's load hits both; the ratio is the median of the per-pair
ratios (the ratio of the medians is printed too). Before, the baseline stopped at the PIL image
(no PNG) while ours included it, one warm-up, 5 pairs; the old figure, without the PNG on the
monolithic side, is still printed ("pipeline only").
Checks the images are identical (decoded from ours, against the pipeline's), then prints the
median wall time of each and their ratio.
Usage: ``python bench/overhead.py [--steps 4] [--runs 9]`` (``make bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from libs.launcher import brokers  # noqa: E402
from libs.launcher.stack import Stack  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--models", default=str(REPO / "models"))
    ap.add_argument("--size", default="256x256")
    args = ap.parse_args()

    import numpy as np
    import torch
    from diffusers import FluxPipeline
    from PIL import Image

    from libs.models.flux_workflows import bench_flux
    from libs.models.tiny_flux import build_flux
    from libs.workflow.spec import encode_spec
    from services.executor.images import encode_png
    from tests.conftest import cleanup_namespace, free_port

    torch.set_num_threads(1)
    models = Path(args.models)
    build_flux(models / "bench-flux", preset="bench")
    width, height = (int(x) for x in args.size.split("x"))
    prompt, seed, msl = "a lighthouse at dusk, oil painting", 42, 64

    nats_url, redis_url = "nats://127.0.0.1:4222", "redis://127.0.0.1:6379/0"
    var = REPO / "var" / "bench"
    started = brokers.ensure_brokers(nats_url, redis_url, var, log=lambda *_: None)
    stack = Stack(
        namespace="bench" + uuid.uuid4().hex[:6],
        log_dir=var / "logs",
        model_root=models.resolve(),
        gateway_port=free_port(),
        executors=2,
        api_keys="sk-bench=bench:admin",
        nats_url=nats_url,
        redis_url=redis_url,
        executor_arena_mb=512,
    )
    pipe = FluxPipeline.from_pretrained(models / "bench-flux")
    pipe.set_progress_bar_config(disable=True)
    n_params = sum(p.numel() for p in pipe.transformer.parameters())

    def mono() -> tuple[float, float, np.ndarray]:
        """(seconds with the PNG, seconds of the pipeline alone, the image)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            img = pipe(
                prompt,
                height=height,
                width=width,
                num_inference_steps=args.steps,
                guidance_scale=3.5,
                generator=torch.Generator().manual_seed(seed),
                max_sequence_length=msl,
            ).images[0]
        t1 = time.perf_counter()
        arr = np.array(img)
        encode_png(torch.from_numpy(arr))
        return time.perf_counter() - t0, t1 - t0, arr

    def decomposed() -> tuple[float, np.ndarray]:
        body = {
            "model": "bench-flux",
            "prompt": prompt,
            "seed": seed,
            "num_inference_steps": args.steps,
            "size": args.size,
        }
        t0 = time.perf_counter()
        status, resp = stack.http("POST", "/v1/images/generations", body)
        dt = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"generation failed: {status} {resp}\n{stack.tail('scheduler')}")
        return dt, np.array(Image.open(io.BytesIO(base64.b64decode(resp["data"][0]["b64_json"]))))

    try:
        stack.start()
        status, body = stack.http("POST", "/v1/workflows", json.loads(encode_spec(bench_flux())))
        assert status in (200, 201), body
        # Warm-up: loads every model once on the executors (and in this process), not timed; a
        # second round runs on warm executors whichever of them the scheduler picks.
        _, _, ref = mono()
        _, first = decomposed()
        identical = bool(np.array_equal(ref, first))
        mono()
        _, img2 = decomposed()
        identical &= bool(np.array_equal(ref, img2))
        t_mono, t_pipe, t_dec = [], [], []
        for _ in range(args.runs):  # interleaved, so drift in machine load hits both alike
            dt, dt_pipe, img = mono()
            t_mono.append(dt)
            t_pipe.append(dt_pipe)
            dt, img2 = decomposed()
            t_dec.append(dt)
            identical &= bool(np.array_equal(img, img2)) and bool(np.array_equal(img, ref))
    finally:
        stack.stop()
        asyncio.run(cleanup_namespace(nats_url, redis_url, stack.namespace))
        brokers.stop(started)

    m_mono, m_pipe, m_dec = statistics.median(t_mono), statistics.median(t_pipe), statistics.median(t_dec)
    ratio = statistics.median(d / m for d, m in zip(t_dec, t_mono, strict=True))
    ratio_pipe = statistics.median(d / m for d, m in zip(t_dec, t_pipe, strict=True))
    nodes = 4 + 2 * args.steps
    print(
        f"bench-flux: {n_params / 1e6:.1f}M-parameter DiT, {args.size}, {args.steps} steps, {nodes} nodes, 1 thread per executor"
    )
    print(f"images identical (decomposed vs monolithic, every run): {identical}")
    print(f"{'':34s}{'median s':>10s}{'min s':>8s}{'max s':>8s}")
    print(f"{'monolithic FluxPipeline + PNG':34s}{m_mono:10.3f}{min(t_mono):8.3f}{max(t_mono):8.3f}")
    print(f"{'  of which the pipeline alone':34s}{m_pipe:10.3f}{min(t_pipe):8.3f}{max(t_pipe):8.3f}")
    print(f"{'decomposed (2 executors)':34s}{m_dec:10.3f}{min(t_dec):8.3f}{max(t_dec):8.3f}")
    print(
        f"ratio decomposed / monolithic: {ratio:.3f} (median of {args.runs} pairs; ratio of medians "
        f"{m_dec / m_mono:.3f}; overhead {1000 * (m_dec - m_mono) / nodes:+.1f} ms per node)"
    )
    print(f"ratio against the pipeline alone (no PNG, the method before 2026-11-30): {ratio_pipe:.3f}")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(
        json.dumps(
            {
                "mono_s": t_mono,
                "mono_pipeline_only_s": t_pipe,
                "decomposed_s": t_dec,
                "ratio": ratio,
                "ratio_of_medians": m_dec / m_mono,
                "ratio_pipeline_only": ratio_pipe,
                "identical": identical,
                "steps": args.steps,
                "method": "interleaved pairs after 2 warm-ups; ratio = median per-pair ratio; "
                "monolithic includes encode_png",
            },
            indent=1,
        )
    )
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
