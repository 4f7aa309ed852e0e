"""A Stable Diffusion 1.5-style family built from configs with random weights (no hub), for tests.

``build(out_root)`` writes three artifacts under ``out_root`` and returns their paths by name:

* ``tiny-sd15/``: a ``StableDiffusionPipeline`` saved with ``save_pretrained`` (CLIP text encoder,
  UNet, VAE, DDIM scheduler; no safety checker, no feature extractor).
* ``tiny-sd15-controlnet/``: a ``ControlNetModel`` made with ``ControlNetModel.from_unet`` from that
  pipeline's UNet, saved with ``save_pretrained`` (config.json + weights at the folder's root, the
  layout of a standalone ControlNet checkpoint).
* ``loras/tiny-sd15-style.safetensors``: a UNet LoRA made with peft's ``LoraConfig``, exported with
  ``get_peft_model_state_dict`` and saved with the pipeline's ``save_lora_weights`` (with its
  adapter metadata, so ``lora_alpha`` travels with the file).

Random weights that are zero by construction are re-drawn, or the test would compare nothing:
a ControlNet's "zero convolutions" (``controlnet_cond_embedding.conv_out``, ``controlnet_down_blocks``,
``controlnet_mid_block``) and a fresh LoRA's ``lora_B`` all start at zero, so their outputs would
leave the UNet unchanged.

Each artifact is built into a temporary sibling and renamed into place; its manifest
(``t2i-model.json`` in a folder, ``<stem>.t2i-model.json`` beside the LoRA file) is written last, so
an interrupted build never looks complete, and a complete one is left alone (idempotent; the
mechanics are :mod:`libs.models.build_utils`').

Sizes: the UNet has two blocks of 16/32 channels, the VAE two blocks (scale factor 2), the text
encoder hidden size 32. A 64x64, 3-step image with CFG takes a few tens of milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from libs.models.build_utils import (
    MANIFEST,
    build_file,
    build_folder,
    clip_tokenizer,
    random_lora_,
    randomize_,
    sidecar_path,
)
from libs.models.build_utils import read_manifest as read_manifest  # re-exported: tests read manifests

FAMILY = "sd15"
BASE = "tiny-sd15"
CONTROLNET = "tiny-sd15-controlnet"
LORA = "tiny-sd15-style"
LORA_FILE = f"loras/{LORA}.safetensors"

_TEXT_DIM = 32  # CLIP hidden size = the UNet's cross_attention_dim


# -- manifests -----------------------------------------------------------------------------------


def manifest_for(kind: str, seed: int) -> dict[str, Any]:
    return {"family": FAMILY, "kind": kind, "seed": int(seed)}


def lora_manifest_path(lora_file: str | os.PathLike[str]) -> Path:
    return sidecar_path(lora_file, "." + MANIFEST)


# -- components ----------------------------------------------------------------------------------


def sd_pipeline(seed: int = 0) -> Any:
    """A ``StableDiffusionPipeline`` with weights drawn from ``torch.manual_seed(seed)``."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    tokenizer = clip_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer.get_vocab()),
            hidden_size=_TEXT_DIM,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            max_position_embeddings=77,
            projection_dim=_TEXT_DIM,
            bos_token_id=0,  # the tokenizer's <|startoftext|>
            eos_token_id=1,  # <|endoftext|>: CLIP pools there
            pad_token_id=1,
        )
    )
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),  # SD1.5's order, two levels
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=_TEXT_DIM,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    vae = AutoencoderKL(
        sample_size=64,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
    )
    # SD1.5's DDIM settings (as in its model card's "use DDIM" recipe).
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def controlnet_from_unet(unet: Any, seed: int = 0) -> Any:
    """``ControlNetModel.from_unet(unet)`` with its zero convolutions re-drawn at random."""
    from diffusers import ControlNetModel

    # The conditioning embedding downsamples by 2 ** (len - 1): 2, the tiny VAE's scale factor.
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16))
    zero_modules = [controlnet.controlnet_cond_embedding.conv_out, *controlnet.controlnet_down_blocks]
    zero_modules.append(controlnet.controlnet_mid_block)
    randomize_([p for m in zero_modules for p in m.parameters()], seed=seed + 1, std=0.2)
    return controlnet


def lora_state_dict(unet: Any, seed: int = 0, rank: int = 4, alpha: int = 8) -> tuple[dict[str, Any], dict]:
    """A random LoRA for ``unet``'s attention projections: (state dict, adapter metadata).

    ``unet`` gets a peft adapter named ``"default"`` attached (use a throw-away copy)."""
    import torch

    torch.manual_seed(seed)  # lora_A's kaiming init; lora_B (zero-initialised by peft) from seed + 1
    # peft's key names (``...to_q.lora_A.weight``); save_lora_weights adds the ``unet.`` prefix
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    return random_lora_(unet, seed=seed + 1, std=0.5, r=rank, lora_alpha=alpha, target_modules=targets)


# -- builds --------------------------------------------------------------------------------------


def build_lora(base_dir: str | os.PathLike[str], out_file: str | os.PathLike[str], seed: int = 0) -> Path:
    """A random UNet LoRA for the pipeline at ``base_dir``, saved at ``out_file`` (idempotent)."""
    out = Path(out_file)

    def save(tmp: Path) -> None:
        from diffusers import StableDiffusionPipeline, UNet2DConditionModel

        unet = UNet2DConditionModel.from_pretrained(base_dir, subfolder="unet")
        layers, metadata = lora_state_dict(unet, seed=seed)
        StableDiffusionPipeline.save_lora_weights(
            tmp, unet_lora_layers=layers, weight_name=out.name, unet_lora_adapter_metadata=metadata
        )

    return build_file(out, lora_manifest_path(out), manifest_for("lora", seed), save)


def build(out_root: str | os.PathLike[str], seed: int = 0) -> dict[str, Path]:
    """Build the base pipeline, its ControlNet and a LoRA under ``out_root``; skip what is built."""
    import torch
    from diffusers import UNet2DConditionModel

    root = Path(out_root)
    base = build_folder(
        root / BASE, manifest_for("pipeline", seed), lambda tmp: sd_pipeline(seed).save_pretrained(tmp)
    )

    def save_controlnet(tmp: Path) -> None:
        torch.manual_seed(seed)
        unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
        controlnet_from_unet(unet, seed=seed).save_pretrained(tmp)

    controlnet = build_folder(root / CONTROLNET, manifest_for("controlnet", seed), save_controlnet)
    lora = build_lora(base, root / LORA_FILE, seed=seed)
    return {BASE: base, CONTROLNET: controlnet, LORA: lora}
