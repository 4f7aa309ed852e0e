"""Train the tiny Flux shapes model: ``python -m libs.trained.train --out DIR --seed 0``.

The recipe (docs/trained-model.md):

1. **data**: ``--images`` scenes of the training combinations (:data:`libs.trained.shapes.TRAIN`),
   data set seed = ``--seed``;
2. **VAE**: ``AutoencoderKL`` trained as an autoencoder (``--vae-steps``, batch 32, AdamW): MSE + L1
   reconstruction of a posterior sample plus a small KL term (:data:`KL_WEIGHT`); then
   ``shift_factor`` / ``scaling_factor`` are set to the mean and 1/std of the posterior means of the
   whole data set;
3. **text**: the random text encoders stay frozen; each training caption's ``encode_prompt``
   output (``max_sequence_length`` 16) is computed once;
4. **transformer**: rectified flow on the packed latents, exactly FluxPipeline's convention:
   ``x_t = (1 - sigma) * x0 + sigma * noise`` with ``sigma ~ U(0, 1)``, target ``noise - x0``, the
   transformer called with ``timestep = sigma`` (the pipeline passes ``timesteps / 1000``), the
   pipeline's ``_pack_latents`` / ``_prepare_latent_image_ids``, no guidance; AdamW with warm-up and
   cosine decay, an exponential moving average of the weights (:data:`EMA`) is what is saved;
5. **evaluation**: the saved pipeline draws every held-out caption for ``--eval-seeds`` seeds;
   :mod:`libs.trained.evaluate` scores them.

Everything random comes from ``--seed`` (torch generators seeded from it, numpy generators of
:mod:`libs.trained.shapes`) and torch runs on ``--threads`` threads (default 1), so a run is
reproducible on one machine. Writes the pipeline folder (``save_pretrained``) and
``training.json`` (settings, time, losses, accuracies) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from libs.trained import evaluate, model, shapes

KL_WEIGHT = 1e-5
EMA = 0.998
VAE_BATCH = 32
EVAL_STEPS = 12
REPORT = "training.json"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def to_tensor(images: Any) -> Any:
    """uint8 [N, H, W, 3] -> float [N, 3, H, W] in [-1, 1]."""
    import torch

    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def _cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def train_vae(vae: Any, data: Any, steps: int, seed: int, lr: float = 2e-3, log: Callable = _log) -> float:
    """Autoencoder training of ``vae`` on ``data`` ([-1, 1] images); returns the last loss (mean of
    the last 20 steps)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, steps, min(50, steps)))
    vae.train()
    recent: list[float] = []
    for step in range(steps):
        x = data[torch.randint(len(data), (VAE_BATCH,), generator=g)]
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=g)).sample
        loss = (rec - x).pow(2).mean() + (rec - x).abs().mean() + KL_WEIGHT * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        recent = (recent + [loss.item()])[-20:]
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step}/{steps} loss {sum(recent) / len(recent):.4f}")
    vae.eval()
    vae.requires_grad_(False)
    return sum(recent) / max(len(recent), 1)


def encode_latents(vae: Any, data: Any) -> Any:
    """Posterior means of ``data``, unscaled [N, C, h, w]."""
    import torch

    with torch.no_grad():
        return torch.cat([vae.encode(data[i : i + 256]).latent_dist.mean for i in range(0, len(data), 256)])


def set_latent_scale(vae: Any, latents: Any) -> tuple[float, float]:
    """Set the VAE config's shift_factor (mean) and scaling_factor (1 / std) from ``latents``."""
    shift = float(latents.mean())
    scale = float(1.0 / (latents - shift).std())
    vae.register_to_config(shift_factor=round(shift, 6), scaling_factor=round(scale, 6))
    return vae.config.shift_factor, vae.config.scaling_factor


def text_features(pipe: Any, captions: list[str]) -> tuple[Any, Any, Any]:
    """``encode_prompt`` of every caption: prompt_embeds [N, L, D], pooled [N, D], text_ids."""
    import torch

    with torch.no_grad():
        return pipe.encode_prompt(captions, None, max_sequence_length=model.MAX_SEQUENCE_LENGTH)


def train_transformer(
    pipe: Any,
    x0: Any,
    caption_index: Any,
    text: tuple[Any, Any, Any],
    steps: int,
    batch: int,
    seed: int,
    lr: float = 1e-3,
    log: Callable = _log,
) -> float:
    """Rectified-flow training of ``pipe.transformer`` on scaled latents ``x0`` [N, C, h, w] whose
    captions are ``caption_index`` into ``text``; leaves the EMA weights in the transformer and
    returns the last loss (mean of the last 50 steps)."""
    import torch

    embeds, pooled, text_ids = text
    tr = pipe.transformer
    _, c, h, w = x0.shape
    img_ids = pipe._prepare_latent_image_ids(batch, h // 2, w // 2, "cpu", torch.float32)  # noqa: SLF001
    g = torch.Generator().manual_seed(seed + 2)
    params = [p for p in tr.parameters() if p.requires_grad]
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, steps, min(100, steps)))
    tr.train()
    recent: list[float] = []
    for step in range(steps):
        idx = torch.randint(len(x0), (batch,), generator=g)
        clean = pipe._pack_latents(x0[idx], batch, c, h, w)  # noqa: SLF001
        noise = torch.randn(clean.shape, generator=g)
        sigma = torch.rand(batch, generator=g)
        noisy = (1.0 - sigma[:, None, None]) * clean + sigma[:, None, None] * noise
        cap = caption_index[idx]
        pred = tr(
            hidden_states=noisy,
            timestep=sigma,
            guidance=None,
            pooled_projections=pooled[cap],
            encoder_hidden_states=embeds[cap],
            txt_ids=text_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        loss = (pred - (noise - clean)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            for e, p in zip(ema, params, strict=True):
                e.lerp_(p, 1.0 - EMA)
        recent = (recent + [loss.item()])[-50:]
        if step % 100 == 0 or step == steps - 1:
            log(f"transformer step {step}/{steps} loss {sum(recent) / len(recent):.4f}")
    with torch.no_grad():
        for e, p in zip(ema, params, strict=True):
            p.copy_(e)
    tr.eval()
    return sum(recent) / max(len(recent), 1)


def generate(pipe: Any, caption: str, seed: int, steps: int = EVAL_STEPS) -> Any:
    """One 64x64 image of ``caption`` as the flux-shapes workflow makes it (uint8 [64, 64, 3])."""
    import numpy as np
    import torch

    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt=caption,
        height=shapes.SIZE,
        width=shapes.SIZE,
        num_inference_steps=steps,
        max_sequence_length=model.MAX_SEQUENCE_LENGTH,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).images[0]
    return np.round(image * 255).clip(0, 255).astype(np.uint8)


def model_accuracy(pipe: Any, captions: Sequence[str], seeds: Sequence[int], steps: int) -> dict[str, float]:
    """The evaluator's accuracy on ``pipe``'s images of every caption for every seed."""
    verdicts = [evaluate.score(generate(pipe, c, s, steps), c) for c in captions for s in seeds]
    return {k: round(v, 4) for k, v in evaluate.accuracy(verdicts).items()}


def generator_accuracy(n: int, seed: int) -> dict[str, float]:
    """The evaluator's accuracy on ``n`` generator images of every combination."""
    scenes, images = shapes.dataset(n, seed, shapes.all_scenes())
    verdicts = [evaluate.score(img, s.caption) for s, img in zip(scenes, images, strict=True)]
    return {k: round(v, 4) for k, v in evaluate.accuracy(verdicts).items()}


def train(
    seed: int, images: int, vae_steps: int, steps: int, batch: int, log: Callable = _log
) -> tuple[Any, dict[str, Any]]:
    """The trained pipeline and the run's figures (no evaluation)."""
    import torch

    t0 = time.monotonic()
    pipe = model.pipeline(seed)
    for part in (pipe.text_encoder, pipe.text_encoder_2):
        part.requires_grad_(False)
    scenes, pictures = shapes.dataset(images, seed)
    data = to_tensor(pictures)
    log(f"{images} images of {len(shapes.TRAIN)} training combinations")
    vae_loss = train_vae(pipe.vae, data, vae_steps, seed, log=log)
    t_vae = time.monotonic() - t0
    raw = encode_latents(pipe.vae, data)
    shift, scale = set_latent_scale(pipe.vae, raw)
    x0 = (raw - shift) * scale
    captions = sorted({s.caption for s in scenes})
    lookup = {c: i for i, c in enumerate(captions)}
    caption_index = torch.tensor([lookup[s.caption] for s in scenes])
    text = text_features(pipe, captions)
    log(f"latents {tuple(raw.shape[1:])}, shift {shift} scale {scale}; {len(captions)} captions")
    tr_loss = train_transformer(pipe, x0, caption_index, text, steps, batch, seed, log=log)
    figures = {
        "seed": seed,
        "images": images,
        "vae_steps": vae_steps,
        "vae_batch": VAE_BATCH,
        "transformer_steps": steps,
        "transformer_batch": batch,
        "threads": torch.get_num_threads(),
        "vae_final_loss": round(vae_loss, 5),
        "transformer_final_loss": round(tr_loss, 5),
        "vae_shift_factor": shift,
        "vae_scaling_factor": scale,
        "vae_seconds": round(t_vae, 1),
        "train_seconds": round(time.monotonic() - t0, 1),
        "parameters": {
            n: sum(p.numel() for p in getattr(pipe, n).parameters())
            for n in ("transformer", "vae", "text_encoder", "text_encoder_2")
        },
    }
    return pipe, figures


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m libs.trained.train", description=__doc__)
    ap.add_argument("--out", required=True, help="the pipeline folder to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images", type=int, default=8000)
    ap.add_argument("--vae-steps", type=int, default=600)
    ap.add_argument("--steps", type=int, default=2400, help="transformer steps")
    ap.add_argument("--batch", type=int, default=64, help="transformer batch")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-seeds", type=int, default=4, help="seeds per held-out caption (0: none)")
    ap.add_argument("--eval-steps", type=int, default=EVAL_STEPS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe, figures = train(args.seed, args.images, args.vae_steps, args.steps, args.batch)
    out = Path(args.out)
    pipe.save_pretrained(out)
    if args.eval_seeds:
        t0 = time.monotonic()
        held = [s.caption for s in shapes.HELD_OUT]
        figures["sampling"] = {"num_inference_steps": args.eval_steps, "shift": model.SHIFT}
        figures["generator_accuracy"] = generator_accuracy(2000, args.seed + 100)
        figures["held_out_accuracy"] = model_accuracy(pipe, held, range(args.eval_seeds), args.eval_steps)
        figures["held_out_images"] = len(held) * args.eval_seeds
        figures["eval_seconds"] = round(time.monotonic() - t0, 1)
    (out / REPORT).write_text(json.dumps(figures, indent=2) + "\n")
    _log(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
