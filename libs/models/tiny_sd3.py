"""A Stable Diffusion 3-style family built from configs with random weights (no hub), for tests.

``build(out_root)`` writes three artifacts under ``out_root`` and returns their paths by name:

* ``tiny-sd3/``: a ``StableDiffusion3Pipeline`` saved with ``save_pretrained``: two CLIP text
  encoders with projection (the CLIP-L / CLIP-G pair), a T5 encoder, an ``SD3Transformer2DModel``,
  an ``AutoencoderKL`` with SD3's 16 latent channels and shift/scaling constants, and SD3's
  ``FlowMatchEulerDiscreteScheduler(shift=3.0)`` (no dynamic shifting, as in SD3-medium).
* ``tiny-sd3-controlnet/``: an ``SD3ControlNetModel`` saved with ``save_pretrained`` (config.json +
  weights at the folder's root: the layout of a standalone SD3 ControlNet checkpoint such as
  InstantX's), with ``force_zeros_for_pooled_projection=True`` (InstantX style: zero pooled
  projections, control latents without the VAE shift).
* ``loras/tiny-sd3-style.safetensors``: a LoRA on the transformer's joint-attention projections made
  with peft's ``LoraConfig``, exported with ``get_peft_model_state_dict`` and saved with the
  pipeline's ``save_lora_weights`` (adapter metadata included).

Tokenizers are the in-memory ones of :mod:`libs.models.build_utils` (both CLIPs share the CLIP vocabulary;
ids 0/1 are bos/eos, matching the text configs, since CLIP pools at the eos id).

Dimensions mirror SD3's layout at toy size: CLIP-L hidden 16 and CLIP-G hidden 32 are concatenated
(48) and zero-padded to T5's width (64 = the transformer's ``joint_attention_dim``), as SD3 pads
768 + 1280 to 4096; the pooled projections concatenate to 16 + 32 = 48 = ``pooled_projection_dim``.
The transformer has 4 joint blocks (the last is ``context_pre_only``), patch size 2 and 2 heads of 16;
the ControlNet 2 blocks, whose samples the transformer adds after its blocks 0-1 and 2 (the last,
``context_pre_only``, takes none). The VAE has two blocks (scale factor 2), so a 64x64 image is 16x16
patches.

Random weights that are zero by construction are re-drawn, or the tests would compare nothing:
the ControlNet's ``controlnet_blocks`` and ``pos_embed_input`` are zero modules, and a fresh
LoRA's ``lora_B`` is zero.

The LoRA has ``lora_alpha == r``: ``sd3.transformer`` loads state dicts without the saved adapter
metadata, and diffusers then infers ``lora_alpha = r`` (``sd3.transformer`` refuses a file whose
metadata says otherwise rather than produce a silently different image).

Each artifact is built into a temporary sibling and renamed into place; its manifest
(``t2i-model.json`` in a folder, ``<stem>.t2i-model.json`` beside the LoRA file) is written last, so an
interrupted build never looks complete, and a complete one is left alone (idempotent; the mechanics
are :mod:`libs.models.build_utils`').
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
    t5_tokenizer,
)
from libs.models.build_utils import read_manifest as read_manifest  # re-exported: tests read manifests

FAMILY = "sd3"
BASE = "tiny-sd3"
CONTROLNET = "tiny-sd3-controlnet"
LORA = "tiny-sd3-style"
LORA_FILE = f"loras/{LORA}.safetensors"

_CLIP_L_DIM = 16
_CLIP_G_DIM = 32
_T5_DIM = 64  # = joint_attention_dim; > CLIP-L + CLIP-G, so the CLIP embeddings get zero-padded
_POOLED_DIM = _CLIP_L_DIM + _CLIP_G_DIM
_HEADS, _HEAD_DIM = 2, 16  # inner dim 32 = caption_projection_dim
_LATENT_CHANNELS = 16  # SD3's VAE

_TRANSFORMER = dict(
    sample_size=32,
    patch_size=2,
    in_channels=_LATENT_CHANNELS,
    num_layers=4,
    attention_head_dim=_HEAD_DIM,
    num_attention_heads=_HEADS,
    joint_attention_dim=_T5_DIM,
    caption_projection_dim=_HEADS * _HEAD_DIM,
    pooled_projection_dim=_POOLED_DIM,
    out_channels=_LATENT_CHANNELS,
    pos_embed_max_size=64,  # up to 256x256 pixels (128 latents, 64 patches a side)
)

_LORA_RANK = 4
_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]


# -- manifests -----------------------------------------------------------------------------------


def manifest_for(kind: str, seed: int) -> dict[str, Any]:
    return {"family": FAMILY, "kind": kind, "seed": int(seed)}


def lora_manifest_path(lora_file: str | os.PathLike[str]) -> Path:
    return sidecar_path(lora_file, "." + MANIFEST)


# -- components ----------------------------------------------------------------------------------


def _clip(vocab_size: int, hidden: int, heads: int) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden + 5,
            num_attention_heads=heads,
            num_hidden_layers=2,
            max_position_embeddings=77,
            projection_dim=hidden,
            bos_token_id=0,  # the tokenizer's <|startoftext|>
            eos_token_id=1,  # <|endoftext|>: CLIP pools there
            pad_token_id=1,
        )
    )


def sd3_pipeline(seed: int = 0) -> Any:
    """A ``StableDiffusion3Pipeline`` with weights drawn from ``torch.manual_seed(seed)``."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    clip_vocab = len(tokenizer.get_vocab())
    text_encoder = _clip(clip_vocab, _CLIP_L_DIM, heads=2)
    text_encoder_2 = _clip(clip_vocab, _CLIP_G_DIM, heads=4)
    text_encoder_3 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_3.get_vocab()),
            d_model=_T5_DIM,
            d_kv=16,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )  # type: ignore[call-arg]
    )
    transformer = SD3Transformer2DModel(**_TRANSFORMER)
    vae = AutoencoderKL(
        sample_size=64,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=4,
        use_quant_conv=False,  # SD3's VAE has neither
        use_post_quant_conv=False,
        shift_factor=0.0609,  # SD3's VAE constants
        scaling_factor=1.5305,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3-medium's
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def sd3_controlnet(seed: int = 0, num_layers: int = 2, force_zeros_for_pooled_projection: bool = True) -> Any:
    """An ``SD3ControlNetModel`` matching :func:`sd3_pipeline`'s transformer, zero modules re-drawn."""
    import torch
    from diffusers import SD3ControlNetModel

    torch.manual_seed(seed)
    controlnet: Any = SD3ControlNetModel(
        **{**_TRANSFORMER, "num_layers": num_layers},
        force_zeros_for_pooled_projection=force_zeros_for_pooled_projection,
    )
    zero_modules = [*controlnet.controlnet_blocks, controlnet.pos_embed_input]
    randomize_([p for m in zero_modules for p in m.parameters()], seed=seed + 1, std=0.2)
    return controlnet


def lora_state_dict(transformer: Any, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random LoRA for ``transformer``'s attention projections: (state dict, adapter metadata).

    ``transformer`` gets a peft adapter named ``"default"`` attached (use a throw-away copy)."""
    import torch

    torch.manual_seed(seed)  # lora_A's kaiming init; lora_B (zero-initialised by peft) from seed + 1
    return random_lora_(
        transformer, seed=seed + 1, std=0.5, r=_LORA_RANK, lora_alpha=_LORA_RANK, target_modules=_LORA_TARGETS
    )


# -- builds --------------------------------------------------------------------------------------


def build_lora(base_dir: str | os.PathLike[str], out_file: str | os.PathLike[str], seed: int = 0) -> Path:
    """A random transformer LoRA for the pipeline at ``base_dir``, saved at ``out_file`` (idempotent)."""
    out = Path(out_file)

    def save(tmp: Path) -> None:
        from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

        transformer = SD3Transformer2DModel.from_pretrained(base_dir, subfolder="transformer")
        layers, metadata = lora_state_dict(transformer, seed=seed)
        StableDiffusion3Pipeline.save_lora_weights(
            tmp,
            transformer_lora_layers=layers,
            weight_name=out.name,
            transformer_lora_adapter_metadata=metadata,
        )

    return build_file(out, lora_manifest_path(out), manifest_for("lora", seed), save)


def build(out_root: str | os.PathLike[str], seed: int = 0) -> dict[str, Path]:
    """Build the base pipeline, its ControlNet and a LoRA under ``out_root``; skip what is built."""
    root = Path(out_root)
    base = build_folder(
        root / BASE, manifest_for("pipeline", seed), lambda tmp: sd3_pipeline(seed).save_pretrained(tmp)
    )
    controlnet = build_folder(
        root / CONTROLNET,
        manifest_for("controlnet", seed),
        lambda tmp: sd3_controlnet(seed).save_pretrained(tmp),
    )
    lora = build_lora(base, root / LORA_FILE, seed=seed)
    return {BASE: base, CONTROLNET: controlnet, LORA: lora}
