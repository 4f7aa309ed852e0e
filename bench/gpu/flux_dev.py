"""Flux-dev at its released configuration on one GPU: the monolithic FluxPipeline against the
decomposed workflow through the stack, the data plane's time per step, cold loads (ours against
safetensors and ``from_pretrained``), and the paper's Fig. 12-left pair ppl.(Lₑ′) against w/o load.

The model: ``FluxTransformer2DModel`` at Flux.1-dev's published configuration (19 double and 38
single blocks, 24 heads of 128, 11.9 B parameters), its VAE and CLIP-L at theirs, T5-XXL's width
with ``--t5-layers`` of its 24 blocks (default 2: the full encoder would add 9.5 GB to the disk the
run writes twice, and it runs once per request, not per step); random weights built on the GPU in
``--dtype`` (bf16), the tiny families' in-memory tokenizers. Saved with ``save_pretrained`` under
``--work``. Where the disk has less room than two copies of the model (the original and its
converted checkpoint), the transformer is built with fewer single blocks and the JSON says so.

1. **Monolithic**: ``FluxPipeline`` on the built components, ``--size`` (1024x1024), ``--steps``
   (28); one untimed warm-up, then ``--runs`` timed.
2. **Decomposed**: gateway, registry, scheduler and ``--executors`` CUDA executors on this GPU
   (device arenas, CUDA IPC between them), the workflow registered and called over HTTP; the
   first request (conversion and loading included) untimed, then ``--runs`` timed; the image compared
   with the monolithic one. The nodes' data-plane time (``fetch_s`` + ``store_s`` of the denoising
   nodes, from the request's progress events) divided by the steps. Needs nats-server and
   redis-server (started where none answers); skipped, with the reason, without them.
3. **Cold load** of the transformer to the GPU, page cache dropped before each
   (``posix_fadvise(DONTNEED)``): the executor's loader (``ModelCache``, no host tier), safetensors'
   ``load_file(device="cuda")`` per shard, and diffusers' ``from_pretrained(...).to("cuda")``.
4. **Fig. 12-left** on this model: one request of ``--prefix-steps`` (4) through the executor's
   model cache in this process, every model resident (w/o load) against every model trimmed to its
   Lₑ′ prefix with the rest reloaded from the page-cached checkpoint while the first layers compute.

Writes ``--json`` (``decomposed_vs_monolithic``, ``load_vs_safetensors``, ``dataplane_s_per_step``,
``prefix`` …); a step that could not run says why under ``skipped``.

    python bench/gpu/flux_dev.py [--work var/bench/flux-dev] [--json out.json]
    python bench/gpu/flux_dev.py --tiny --device cpu    # the same path on the tiny model (a CPU check)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

NAME = "flux-dev-bench"
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED = 42
#: FluxTransformer2DModel as FLUX.1-dev ships it.
DEV_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=[16, 56, 56],
)  # fmt: skip


def build(args: argparse.Namespace, out: Path, log: Any) -> dict[str, Any]:
    """Build the pipeline on the device, save it under ``out`` and return it with what was built."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from libs.models.build_utils import clip_tokenizer, t5_tokenizer

    if args.tiny:
        from libs.models.tiny_flux import flux_pipeline

        pipe = flux_pipeline("tiny", 0).to(args.device)
        info = {"config": "tiny", "single_blocks": pipe.transformer.config.num_single_layers}
    else:
        dtype = getattr(torch, args.dtype)
        config = dict(DEV_TRANSFORMER)
        params_per_single = 12 * 3072 * 3072 + 4 * 3072 * 3072  # attention + 4x MLP, about
        need = 2 * (11.9e9 * 2 + 0.3e9 * 2 + args.t5_layers * 0.2e9 * 2)  # original + converted copy
        free = shutil.disk_usage(out.parent).free
        if free < need + (8 << 30):
            cut = int((need + (8 << 30) - free) / (2 * 2 * params_per_single)) + 1
            config["num_single_layers"] = max(1, 38 - cut)
            log(f"disk has {free / 1e9:.0f} GB free: {config['num_single_layers']} of 38 single blocks")
        tok, tok2 = clip_tokenizer(), t5_tokenizer()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(args.device):
                torch.manual_seed(SEED)
                transformer = FluxTransformer2DModel(**config)
                vae = AutoencoderKL(
                    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                    layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
                    scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
                )  # fmt: skip
                clip = CLIPTextModel(
                    CLIPTextConfig(
                        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
                        hidden_act="quick_gelu", bos_token_id=0, eos_token_id=1, pad_token_id=1,
                    )
                )  # fmt: skip
                t5 = T5EncoderModel(
                    T5Config(
                        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=args.t5_layers,
                        num_heads=64, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
                        pad_token_id=0, eos_token_id=1,
                    )
                )  # fmt: skip
        finally:
            torch.set_default_dtype(prev)
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
            base_shift=0.5, max_shift=1.15,
        )  # fmt: skip
        pipe = FluxPipeline(
            scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tok, text_encoder_2=t5,
            tokenizer_2=tok2, transformer=transformer,
        )  # fmt: skip
        info = {
            "config": "FLUX.1-dev",
            "single_blocks": config["num_single_layers"],
            "t5_layers": args.t5_layers,
        }
    info["transformer_params"] = sum(p.numel() for p in pipe.transformer.parameters())
    t0 = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out)
    info["save_s"] = time.perf_counter() - t0
    info["bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"built {info['config']}: transformer {info['transformer_params'] / 1e9:.2f} B parameters, "
        f"{info['bytes'] / 1e9:.1f} GB saved in {info['save_s']:.0f} s")  # fmt: skip
    return {"pipe": pipe, **info}


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def monolithic(pipe: Any, args: argparse.Namespace) -> tuple[list[float], Any]:
    import numpy as np
    import torch

    pipe.set_progress_bar_config(disable=True)
    w, h = (int(x) for x in args.size.split("x"))

    def once(steps: int) -> Any:
        with torch.no_grad():
            return pipe(
                PROMPT, height=h, width=w, num_inference_steps=steps, guidance_scale=3.5,
                generator=torch.Generator().manual_seed(SEED), max_sequence_length=args.msl,
            ).images[0]  # fmt: skip

    once(2)
    times, image = [], None
    for _ in range(args.runs):
        sync(args.device)
        t0 = time.perf_counter()
        image = once(args.steps)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    return times, np.array(image)


def decomposed(args: argparse.Namespace, work: Path, log: Any) -> dict[str, Any]:
    import numpy as np
    import redis
    from PIL import Image

    from libs.launcher import brokers
    from libs.launcher.stack import Stack
    from libs.models.flux_workflows import flux_workflow
    from libs.protocol.keys import Keys
    from libs.workflow.spec import encode_spec
    from tests.conftest import cleanup_namespace, free_port

    if not (shutil.which("nats-server") and shutil.which("redis-server")):
        return {"skipped": "nats-server or redis-server not found"}
    nats_url, redis_url = "nats://127.0.0.1:4222", "redis://127.0.0.1:6379/0"
    var = work / "var"
    started = brokers.ensure_brokers(nats_url, redis_url, var, log=lambda *_: None)
    env = {"T2I_EXECUTOR_DEVICE": args.device, "T2I_CHECKPOINT_CACHE": str(work / "ckpt-cache")}
    if not args.tiny:
        env["T2I_EXECUTOR_DTYPES"] = f"*={args.dtype}"
    stack = Stack(
        namespace="gpu" + uuid.uuid4().hex[:6], log_dir=var / "logs", model_root=work, gateway_port=free_port(),
        executors=args.executors, api_keys="sk-bench=bench:admin", nats_url=nats_url, redis_url=redis_url,
        executor_arena_mb=args.arena_mb, extra_env=env,
    )  # fmt: skip
    spec = flux_workflow(NAME, NAME, sizes=[args.size], steps=args.steps, max_sequence_length=args.msl)
    body = {
        "model": NAME,
        "prompt": PROMPT,
        "seed": SEED,
        "num_inference_steps": args.steps,
        "size": args.size,
    }
    out: dict[str, Any] = {}
    try:
        stack.start()
        status, resp = stack.http("POST", "/v1/workflows", json.loads(encode_spec(spec)))
        if status not in (200, 201):
            raise RuntimeError(f"register: {status} {resp}")
        t0 = time.perf_counter()
        status, resp = stack.http("POST", "/v1/images/generations", body, timeout=1800)
        out["first_s"] = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"first request: {status} {resp}\n{stack.tail('executor-0')}")
        times, image, rid = [], None, ""
        for _ in range(args.runs):
            t0 = time.perf_counter()
            status, resp = stack.http("POST", "/v1/images/generations", body, timeout=1800)
            times.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"request: {status} {resp}")
            image = np.array(Image.open(io.BytesIO(base64.b64decode(resp["data"][0]["b64_json"]))))
            rid = f"{resp['id']}-0"
        r = redis.Redis.from_url(redis_url)
        try:
            events = [json.loads(f[b"data"]) for _, f in r.xrange(Keys(stack.namespace).events(rid))]
        finally:
            r.close()
        per_node = [e for e in events if e.get("type") == "node"]
        dp = [
            e["timing"]["fetch_s"] + e["timing"]["store_s"]
            for e in per_node
            if e["fn"] in ("flux.transformer", "flux.flow_match_step")
        ]
        out.update(times=times, image=image, dataplane_s=sum(dp), dataplane_nodes=len(dp),
                   executors=sorted({e["executor"] for e in per_node}))  # fmt: skip
        log(f"decomposed: first {out['first_s']:.1f} s, then {statistics.median(times):.2f} s")
    finally:
        stack.stop()
        asyncio.run(cleanup_namespace(nats_url, redis_url, stack.namespace))
        brokers.stop(started)
    return out


def cold_loads(args: argparse.Namespace, work: Path, log: Any) -> dict[str, Any]:
    import torch
    from diffusers import FluxTransformer2DModel
    from loading import drop_cache  # bench/loading.py
    from safetensors.torch import load_file

    from libs.dataplane.loader import Loader
    from services.executor.runtime import ModelCache

    folder = work / NAME
    subprocess.run([sys.executable, "-m", "libs.models.convert", str(folder)], cwd=REPO, check=True,
                   env={**os.environ, "T2I_CHECKPOINT_CACHE": str(work / "ckpt-cache")})  # fmt: skip
    files = [f for f in work.rglob("*") if f.is_file() and (f.suffix in (".safetensors", ".bin"))]
    shards = sorted((folder / "transformer").glob("*.safetensors"))
    dtype = getattr(torch, args.dtype)
    out: dict[str, Any] = {}

    def timed(name: str, fn: Any) -> None:
        resident = drop_cache(files)
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        held = fn()
        sync(args.device)
        out[name] = time.perf_counter() - t0
        out[f"{name}_cache_resident_before"] = resident
        del held
        log(f"cold load {name}: {out[name]:.2f} s")

    def ours() -> Any:
        with Loader() as loader:
            cache = ModelCache(work, args.device, loader, {"*": args.dtype} if not args.tiny else None)
            comps, _ = cache.components("flux.transformer", NAME)
            return comps

    os.environ["T2I_CHECKPOINT_CACHE"] = str(work / "ckpt-cache")
    timed("ours_s", ours)
    timed("safetensors_s", lambda: [load_file(str(s), device=args.device) for s in shards])
    timed(
        "from_pretrained_s",
        lambda: FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=dtype).to(
            args.device
        ),
    )
    out["load_vs_safetensors"] = out["ours_s"] / out["safetensors_s"]
    out["load_vs_from_pretrained"] = out["ours_s"] / out["from_pretrained_s"]
    return out


def prefix(args: argparse.Namespace, work: Path, log: Any) -> dict[str, Any]:
    """Fig. 12-left's ppl.(Lₑ′) against w/o load, through the executor's model cache."""
    import torch

    from libs.dataplane.loader import Loader
    from libs.models.flux_workflows import flux_workflow
    from libs.workflow.local import LocalRunner
    from services.executor.runtime import ModelCache

    w, h = (int(x) for x in args.size.split("x"))
    spec = flux_workflow(NAME, NAME, sizes=[args.size], steps=args.prefix_steps, max_sequence_length=args.msl)
    params = {
        "prompt": PROMPT,
        "seed": SEED,
        "num_inference_steps": args.prefix_steps,
        "width": w,
        "height": h,
    }
    out: dict[str, Any] = {}
    with Loader() as loader:
        cache = ModelCache(work, args.device, loader, {"*": args.dtype} if not args.tiny else None)
        runner = LocalRunner(work, models=cache, device=args.device)
        with torch.no_grad():
            reference = runner.run(spec, params)["image"]  # loads and profiles every model (Lₑ′)
        keeps = {str(k): cache.weights.policy.keep(k) for k in cache.weights.models}
        samples: dict[str, list[float]] = {"w/o load": [], "ppl.(Le')": []}
        for _ in range(args.runs):
            for mode in samples:
                for key in list(cache.weights.models):
                    n = len(cache.weights.models[key].slots)
                    cache.trim(key.fn, key.model, n if mode == "w/o load" else cache.weights.policy.keep(key))
                sync(args.device)
                t0 = time.perf_counter()
                with torch.no_grad():
                    image = runner.run(spec, params)["image"]
                sync(args.device)
                samples[mode].append(time.perf_counter() - t0)
                out.setdefault("same_image", True)
                out["same_image"] &= bool(torch.equal(image.cpu(), reference.cpu()))
    out["keeps"] = keeps
    out["wo_load_s"] = statistics.median(samples["w/o load"])
    out["ppl_le_s"] = statistics.median(samples["ppl.(Le')"])
    out["ppl_le_vs_wo_load"] = out["ppl_le_s"] / out["wo_load_s"]
    log(f"Fig. 12-left: w/o load {out['wo_load_s']:.2f} s, ppl.(Le') {out['ppl_le_s']:.2f} s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(REPO / "var" / "bench" / "flux-dev"))
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "gpu" / "flux_dev.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", default="1024x1024")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--prefix-steps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--msl", type=int, default=512, help="max_sequence_length (T5 tokens)")
    ap.add_argument("--t5-layers", type=int, default=2)
    ap.add_argument("--executors", type=int, default=2)
    ap.add_argument("--arena-mb", type=int, default=1024)
    ap.add_argument("--skip", default="", help="comma list of: decomposed,loads,prefix")
    ap.add_argument("--tiny", action="store_true", help="the tiny Flux model (checks the path on a CPU)")
    args = ap.parse_args()
    if args.tiny:
        args.dtype, args.size, args.steps, args.msl = "float32", "64x64", min(args.steps, 2), 64

    import numpy as np
    import torch

    def log(msg: str) -> None:
        print(f"[flux_dev] {msg}", flush=True)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("no CUDA device")
        return 3
    if args.device == "cpu":
        torch.set_num_threads(1)  # as the executors run: the thread count changes the bits
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "size": args.size, "steps": args.steps, "dtype": args.dtype, "runs": args.runs, "skipped": {},
    }  # fmt: skip
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every step: a run cut short by its time limit keeps what it measured
        out_path.write_text(json.dumps(result, indent=1, default=str))

    built = build(args, work / NAME, log)
    pipe = built.pop("pipe")
    result["model"] = built
    save()
    mono_s, mono_image = monolithic(pipe, args)
    result["monolithic_s"] = mono_s
    save()
    log(f"monolithic: {statistics.median(mono_s):.2f} s")
    del pipe
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    steps = {
        "decomposed": lambda: decomposed(args, work, log),
        "loads": lambda: cold_loads(args, work, log),
        "prefix": lambda: prefix(args, work, log),
    }
    for name, run in steps.items():
        if name in skip:
            result["skipped"][name] = "--skip"
            continue
        try:
            got = run()
        except Exception as e:  # noqa: BLE001 - a step that fails is reported, the others still run
            result["skipped"][name] = f"failed: {type(e).__name__}: {e}"[:2000]
            log(result["skipped"][name])
            continue
        if "skipped" in got:
            result["skipped"][name] = got["skipped"]
            continue
        if name == "decomposed":
            image = got.pop("image")
            result["decomposed_s"] = got["times"]
            result["decomposed_vs_monolithic"] = statistics.median(got["times"]) / statistics.median(mono_s)
            result["identical_to_monolithic"] = bool(np.array_equal(image, mono_image))
            result["max_pixel_diff"] = int(np.abs(image.astype(int) - mono_image.astype(int)).max())
            result["dataplane_s_per_step"] = got["dataplane_s"] / args.steps
            result["decomposed"] = got
        elif name == "loads":
            result["loads"] = got
            result["load_vs_safetensors"] = got["load_vs_safetensors"]
        else:
            result["prefix"] = got
        save()
    save()
    log(
        f"wrote {args.json}: "
        + json.dumps(
            {
                k: result.get(k)
                for k in ("decomposed_vs_monolithic", "load_vs_safetensors", "dataplane_s_per_step")
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
