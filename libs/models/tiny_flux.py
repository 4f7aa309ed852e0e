"""Flux pipelines built from configs with random weights, for tests and CPU benchmarks (no hub).

``build(out_root)`` builds the tiny Flux family under ``out_root`` and returns name -> path:
``tiny-flux`` (dev), ``tiny-flux-schnell``, ``tiny-flux-controlnet`` (a ``FluxControlNetModel`` with
the tiny transformer's dimensions, for dev and schnell alike) and the LoRA file
``loras/tiny-flux-style.safetensors`` (key ``tiny-flux-style``). Every piece is idempotent: a
manifest written last marks it complete (:mod:`libs.models.build_utils`).

``build_flux(out_dir, preset, seed)`` builds a ``FluxPipeline`` from the configs below, seeds torch
first so the weights are a function of ``seed``, saves it with ``save_pretrained`` (the layout every
``load_model`` reads) and writes a manifest, ``t2i-model.json``, last. A folder whose manifest
matches is complete and is not rebuilt; the build goes to a temporary sibling folder that is
renamed into place, so an interrupted build never looks complete
(:func:`~libs.models.build_utils.build_folder`).

The CLIP and T5 tokenizers are the in-memory ones of :mod:`libs.models.build_utils`
(:func:`~libs.models.build_utils.clip_tokenizer`, :func:`~libs.models.build_utils.t5_tokenizer`).

Variants: ``dev`` (guidance embedding; the scheduler shifts with the resolution, like FLUX.1-dev)
and ``schnell`` (no guidance embedding; FLUX.1-schnell's scheduler: ``shift=1.0``, no dynamic
shifting). Both draw their weights from the same seed in the same order, so their text encoders
and VAE are identical; the transformers differ. A schnell folder's manifest adds
``"variant": "schnell"``.

The ControlNet has 1 double and 1 single block (``tiny``; the transformer has 1 and 2, so the
single residuals are spread over two blocks) and embeds guidance, like the dev ControlNets that
are also used with schnell. ``FluxControlNetModel`` zero-initialises its output projections and
``controlnet_x_embedder`` (a fresh ControlNet changes nothing); the builder re-draws them so the
residuals are not zero.

The LoRA (rank 4, alpha 8, so scaling 2) targets the attention and MLP projections of the
transformer's blocks; it is built the way diffusers' Flux LoRA training saves one: a PEFT
``LoraConfig`` added to a transformer of the preset, ``lora_B`` (zero at init) drawn at random,
``get_peft_model_state_dict``, then ``FluxPipeline.save_lora_weights`` with the adapter metadata.
It fits dev and schnell (same block shapes). Its manifest is ``tiny-flux-style.t2i-lora.json``.

Presets (same text encoders in both; each text encoder has hidden size 32):

* ``tiny``: a transformer of 1 double + 2 single blocks with 2 heads of 16 (94,288 parameters)
  and a 2-block VAE (scale factor 2). A 128x128, 4-step image takes ~0.1 s on a CPU.
* ``bench``: a Flux-style transformer with d=512 (4 heads of 128), 4 double + 8 single blocks:
  70,943,760 parameters (272 MiB on disk in fp32). One transformer step at 256x256 (256 packed
  image tokens), measured through ``flux.transformer`` on this 2-core CPU in fp32 (median of 5):
  with a 512-token T5 prompt 0.41 s on 2 threads, 0.76 s on 1 thread; 256 tokens 0.28 / 0.47 s;
  64 tokens 0.16 / 0.29 s. Its VAE has four blocks, i.e. Flux's real 8x compression, so 256x256
  pixels give 16x16 packed tokens as in real Flux (the tiny 2x VAE would give 4,096 tokens and
  ~4.3 s per step); it is still a toy VAE (8-16 channels).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from libs.models import build_utils
from libs.models.build_utils import MANIFEST, clip_tokenizer, t5_tokenizer

FAMILY = "flux"
CONTROLNET_FAMILY = "flux-controlnet"
LORA_FAMILY = "flux-lora"
LORA_MANIFEST_SUFFIX = ".t2i-lora.json"
PRESETS = ("tiny", "bench")
VARIANTS = ("dev", "schnell")

_TEXT_DIM = 32  # hidden size of both tiny text encoders = the transformer's text/pooled dims

_TRANSFORMERS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        pooled_projection_dim=_TEXT_DIM,
        axes_dims_rope=[4, 6, 6],
        guidance_embeds=True,
    ),
    "bench": dict(
        patch_size=1,
        in_channels=16,
        num_layers=4,
        num_single_layers=8,
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=_TEXT_DIM,
        pooled_projection_dim=_TEXT_DIM,
        axes_dims_rope=[16, 56, 56],  # Flux's split of a 128-dim head
        guidance_embeds=True,
    ),
}

_VAE_BLOCKS: dict[str, tuple[int, ...]] = {"tiny": (8, 16), "bench": (8, 16, 16, 16)}

# ControlNet depth per preset: (double blocks, single blocks).
_CONTROLNET_LAYERS: dict[str, tuple[int, int]] = {"tiny": (1, 1), "bench": (2, 4)}

# Transformer modules the LoRA adapts: the blocks' attention projections and the single blocks'
# MLP input (what Flux LoRA trainers commonly target).
_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "proj_mlp",
]
_LORA_RANK, _LORA_ALPHA = 4, 8
_LORA_CONFIG = dict(
    r=_LORA_RANK, lora_alpha=_LORA_ALPHA, init_lora_weights=True, target_modules=_LORA_TARGETS
)
LORA_NAME = "tiny-flux-style"


# -- manifest ------------------------------------------------------------------------------------


def manifest_for(preset: str, seed: int, *, variant: str = "dev", family: str = FAMILY) -> dict[str, Any]:
    data: dict[str, Any] = {"preset": preset, "seed": int(seed), "family": family}
    if variant != "dev":
        data["variant"] = variant
    return data


def write_manifest(
    out_dir: str | os.PathLike[str], preset: str, seed: int, *, variant: str = "dev", family: str = FAMILY
) -> Path:
    """Mark ``out_dir`` as a complete build of ``preset``/``seed``; call after everything else."""
    return build_utils.write_manifest(
        Path(out_dir) / MANIFEST, manifest_for(preset, seed, variant=variant, family=family)
    )


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a built folder, or None if there is none (or it is unreadable)."""
    return build_utils.read_manifest(Path(out_dir) / MANIFEST)


def is_built(
    out_dir: str | os.PathLike[str],
    preset: str = "tiny",
    seed: int = 0,
    *,
    variant: str = "dev",
    family: str = FAMILY,
) -> bool:
    return read_manifest(out_dir) == manifest_for(preset, seed, variant=variant, family=family)


# -- components ----------------------------------------------------------------------------------


def _check(preset: str, variant: str = "dev") -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


def flux_pipeline(preset: str = "tiny", seed: int = 0, variant: str = "dev") -> Any:
    """A ``FluxPipeline`` of ``preset`` with weights drawn from ``torch.manual_seed(seed)``."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    _check(preset, variant)
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer.get_vocab()),
            hidden_size=_TEXT_DIM,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            max_position_embeddings=77,
            projection_dim=_TEXT_DIM,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2.get_vocab()),
            d_model=_TEXT_DIM,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    transformer = FluxTransformer2DModel(**{**_TRANSFORMERS[preset], "guidance_embeds": variant == "dev"})
    blocks = _VAE_BLOCKS[preset]
    vae = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=blocks,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        layers_per_block=1,
        latent_channels=4,  # transformer in_channels / 4 (2x2 packing)
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,  # Flux.1's VAE constants
        scaling_factor=1.5035,
    )
    if variant == "schnell":  # FLUX.1-schnell's scheduler_config.json
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=1.0,
            use_dynamic_shifting=False,
            base_image_seq_len=256,
            max_image_seq_len=4096,
            base_shift=0.5,
            max_shift=1.15,
        )
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_image_seq_len=256,
            max_image_seq_len=4096,
            base_shift=0.5,
            max_shift=1.15,
        )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def build_flux(
    out_dir: str | os.PathLike[str], preset: str = "tiny", seed: int = 0, variant: str = "dev"
) -> Path:
    """Build and save a Flux pipeline folder at ``out_dir``; a no-op if it is already built."""
    _check(preset, variant)
    return build_utils.build_folder(
        out_dir,
        manifest_for(preset, seed, variant=variant),
        lambda tmp: flux_pipeline(preset, seed, variant).save_pretrained(tmp),
    )


def flux_controlnet(preset: str = "tiny", seed: int = 0) -> Any:
    """A ``FluxControlNetModel`` with the transformer dimensions of ``preset`` (VAE-latent input,
    guidance embedding), weights drawn from ``seed``; its zero-initialised projections re-drawn."""
    import torch
    from diffusers import FluxControlNetModel

    _check(preset)
    num_layers, num_single_layers = _CONTROLNET_LAYERS[preset]
    config = {**_TRANSFORMERS[preset], "num_layers": num_layers, "num_single_layers": num_single_layers}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        controlnet = FluxControlNetModel(**config)
        for module in (*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks):
            module.reset_parameters()
        controlnet.controlnet_x_embedder.reset_parameters()
    return controlnet


def build_controlnet(out_dir: str | os.PathLike[str], preset: str = "tiny", seed: int = 0) -> Path:
    """Build and save a ControlNet folder (``FluxControlNetModel.save_pretrained``: config and
    weights at the folder's top) at ``out_dir``; a no-op if it is already built."""
    _check(preset)
    return build_utils.build_folder(
        out_dir,
        manifest_for(preset, seed, family=CONTROLNET_FAMILY),
        lambda tmp: flux_controlnet(preset, seed).save_pretrained(tmp),
    )


def flux_lora(preset: str = "tiny", seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random, non-zero LoRA of the transformer of ``preset``: (state dict, adapter metadata)."""
    import torch
    from diffusers import FluxTransformer2DModel

    _check(preset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(**_TRANSFORMERS[preset])
        # lora_A: kaiming-uniform from the seeded RNG; lora_B (zeros) re-drawn from seed + 1
        state_dict, config = build_utils.random_lora_(transformer, seed=seed + 1, std=0.5, **_LORA_CONFIG)
    # Sets (target_modules) become sorted lists: save_lora_weights would list them in hash order.
    return state_dict, {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def lora_manifest_path(path: str | os.PathLike[str]) -> Path:
    return build_utils.sidecar_path(path, LORA_MANIFEST_SUFFIX)


def build_lora(path: str | os.PathLike[str], preset: str = "tiny", seed: int = 0) -> Path:
    """Write the LoRA safetensors file at ``path`` (``FluxPipeline.save_lora_weights``); a no-op if
    it is there and its manifest (``<stem>.t2i-lora.json``, written last) matches."""
    _check(preset)
    out = Path(path)
    manifest = {**manifest_for(preset, seed, family=LORA_FAMILY), "rank": _LORA_RANK, "alpha": _LORA_ALPHA}

    def save(tmp: Path) -> None:
        from diffusers import FluxPipeline

        state_dict, metadata = flux_lora(preset, seed)
        FluxPipeline.save_lora_weights(
            tmp,
            transformer_lora_layers=state_dict,
            weight_name=out.name,
            transformer_lora_adapter_metadata=metadata,
        )

    return build_utils.build_file(out, lora_manifest_path(out), manifest, save)


def build(out_root: str | os.PathLike[str], seed: int = 0) -> dict[str, Path]:
    """Build the tiny Flux family under ``out_root`` (each piece only if missing or stale)."""
    root = Path(out_root)
    return {
        "tiny-flux": build_flux(root / "tiny-flux", "tiny", seed),
        "tiny-flux-schnell": build_flux(root / "tiny-flux-schnell", "tiny", seed, variant="schnell"),
        "tiny-flux-controlnet": build_controlnet(root / "tiny-flux-controlnet", "tiny", seed),
        LORA_NAME: build_lora(root / "loras" / f"{LORA_NAME}.safetensors", "tiny", seed),
    }
