"""Sana pipelines built from configs with random weights, for tests (no hub, no downloads).

``build(out_root)`` writes three things under ``out_root`` and returns their paths by name:

* ``tiny-sana``: a ``SanaPipeline`` folder (``save_pretrained`` layout: ``tokenizer``,
  ``text_encoder``, ``transformer``, ``vae``, ``scheduler``).
* ``tiny-sana-controlnet``: a ``SanaControlNetPipeline`` folder with the *same* base components
  (bit-identical weights) plus ``controlnet``, so one LoRA serves both.
* ``tiny-sana-style``: ``loras/tiny-sana-style.safetensors``, a LoRA on the transformer's attention
  projections saved with ``SanaPipeline.save_lora_weights``.

Every folder gets a manifest (``t2i-model.json``) written last, and the LoRA a sidecar manifest
(``tiny-sana-style.json``) written after the file; an existing output whose manifest matches is
left alone, so the build is idempotent. Folders are built in a temporary sibling and renamed into
place, so an interrupted build never looks complete (the mechanics are :mod:`libs.models.build_utils`').

What the components are, and why:

* Tokenizer: a ``GemmaTokenizer`` (transformers 5: the fast, ``tokenizers``-backed class that both
  ``GemmaTokenizer`` and ``GemmaTokenizerFast`` name) built from an in-memory BPE vocabulary with no
  merges: Gemma's special tokens at Gemma's ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3,
  ``<mask>`` 4), ``▁`` (Gemma's space), printable ASCII, and the 256 ``<0xNN>`` byte tokens that the
  byte fallback uses for anything else (the complex-human-instruction's newlines, accents).
  ``add_bos_token=True`` as in Gemma, so ``encode_prompt``'s ``select_index`` keeps the ``<bos>``.
  ``save_pretrained`` writes ``tokenizer.json``; ``from_pretrained`` reproduces the ids.
* Text encoder: a one-layer ``Gemma2Model`` (hidden size 16 = the transformer's
  ``caption_channels``), eager attention as in diffusers' Sana tests.
* Transformer: a 2-block ``SanaTransformer2DModel`` (inner dim 8) with ``sample_size=16``, i.e. a
  "512 px" Sana: with resolution binning on, sizes snap to ``ASPECT_RATIO_512_BIN``.
* ControlNet: a 1-block ``SanaControlNetModel`` of the same dims. Its ``input_block`` and
  ``controlnet_blocks`` are zero-initialised by design (so an untrained ControlNet is a no-op);
  they are re-drawn at random here, otherwise the ControlNet image would equal the plain one and a
  test comparing them would prove nothing.
* VAE: an ``AutoencoderDC`` with six stages of 8 channels, i.e. DC-AE's real 32x compression
  (``vae_scale_factor`` 32), so a 512x512 image is 16x16 latents as in real Sana 512.
* Scheduler: ``FlowMatchEulerDiscreteScheduler(shift=7.0)``, what diffusers' Sana tests use (real
  checkpoints ship ``DPMSolverMultistepScheduler``; ``sana.scheduler_step`` handles both).
* LoRA: rank 4 with ``lora_alpha`` 4 on ``to_q``/``to_k``/``to_v``/``to_out.0`` of every attention,
  ``lora_B`` drawn at random (peft initialises it to zero, which would make the LoRA a no-op).
  ``lora_alpha == r`` matters: ``sana.transformer`` loads state dicts without the saved adapter
  metadata, and diffusers then infers ``lora_alpha = r``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from libs.models.build_utils import (
    MANIFEST,
    build_file,
    build_folder,
    random_lora_,
    read_manifest,
    sidecar_path,
)

FAMILY = "sana"
PRESET = "tiny"
BASE_NAME = "tiny-sana"
CONTROLNET_NAME = "tiny-sana-controlnet"
LORA_NAME = "tiny-sana-style"

_TEXT_DIM = 16  # Gemma2 hidden size = the transformer's caption_channels
_LORA_RANK = 4
_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
_LORA_CONFIG = dict(r=_LORA_RANK, lora_alpha=_LORA_RANK, target_modules=_LORA_TARGETS, init_lora_weights=True)

_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=4,
    out_channels=4,
    num_layers=2,
    num_attention_heads=2,
    attention_head_dim=4,
    num_cross_attention_heads=2,
    cross_attention_head_dim=4,
    cross_attention_dim=8,
    caption_channels=_TEXT_DIM,
    sample_size=16,
)
_CONTROLNET: dict[str, Any] = {**_TRANSFORMER, "num_layers": 1}


# -- manifests -----------------------------------------------------------------------------------


def manifest_for(kind: str, seed: int) -> dict[str, Any]:
    return {"family": FAMILY, "preset": PRESET, "kind": kind, "seed": int(seed)}


def lora_path(out_root: str | os.PathLike[str]) -> Path:
    return Path(out_root) / "loras" / f"{LORA_NAME}.safetensors"


def _lora_manifest_path(out_root: str | os.PathLike[str]) -> Path:
    return sidecar_path(lora_path(out_root), ".json")


def is_built(out_root: str | os.PathLike[str], seed: int = 0) -> bool:
    root = Path(out_root)
    return (
        read_manifest(root / BASE_NAME / MANIFEST) == manifest_for("pipeline", seed)
        and read_manifest(root / CONTROLNET_NAME / MANIFEST) == manifest_for("controlnet-pipeline", seed)
        and lora_path(root).is_file()
        and read_manifest(_lora_manifest_path(root)) == manifest_for("lora", seed)
    )


# -- components ----------------------------------------------------------------------------------


def gemma_tokenizer() -> Any:
    """A Gemma tokenizer over single characters (see the module docstring)."""
    from transformers import GemmaTokenizer

    vocab: dict[str, int] = {}
    for token in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁"):
        vocab[token] = len(vocab)
    for code in range(33, 127):  # printable ASCII but the space, which the normalizer makes "▁"
        vocab[chr(code)] = len(vocab)
    for byte in range(256):  # byte fallback, as in Gemma's vocabulary
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True, add_eos_token=False)


def components(seed: int = 0) -> dict[str, Any]:
    """Every component of both pipelines, weights drawn from ``torch.manual_seed(seed)``."""
    import torch
    from diffusers import (
        AutoencoderDC,
        FlowMatchEulerDiscreteScheduler,
        SanaControlNetModel,
        SanaTransformer2DModel,
    )
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    tokenizer = gemma_tokenizer()
    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=len(tokenizer.get_vocab()),
            hidden_size=_TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=4096,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
            attn_implementation="eager",
        )
    )
    transformer = SanaTransformer2DModel(**_TRANSFORMER)
    controlnet = SanaControlNetModel(**_CONTROLNET)
    with torch.no_grad():  # undo zero_module (see the module docstring)
        for layer in [controlnet.input_block, *controlnet.controlnet_blocks]:
            layer.weight.normal_(0.0, 0.3)
            layer.bias.normal_(0.0, 0.1)
    stages = 6  # vae_scale_factor = 2 ** (stages - 1) = 32, as DC-AE f32
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=_TRANSFORMER["in_channels"],
        attention_head_dim=2,
        encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        encoder_block_out_channels=(8,) * stages,
        decoder_block_out_channels=(8,) * stages,
        encoder_layers_per_block=(1,) * stages,
        decoder_layers_per_block=(1,) * stages,
        encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        upsample_block_type="pixel_shuffle",
        downsample_block_type="pixel_unshuffle",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,  # DC-AE f32c32's
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder.eval(),
        "transformer": transformer.eval(),
        "controlnet": controlnet.eval(),
        "vae": vae.eval(),
        "scheduler": scheduler,
    }


def sana_pipeline(seed: int = 0) -> Any:
    from diffusers import SanaPipeline

    parts = components(seed)
    parts.pop("controlnet")
    return SanaPipeline(**parts)


def sana_controlnet_pipeline(seed: int = 0) -> Any:
    from diffusers import SanaControlNetPipeline

    return SanaControlNetPipeline(**components(seed))


def lora_state_dict(transformer: Any, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random non-zero LoRA for ``transformer`` (left unchanged): (peft state dict, LoraConfig dict)."""
    import copy

    # lora_A from the global RNG; lora_B (zero: the adapter would be a no-op) drawn in name order
    return random_lora_(copy.deepcopy(transformer), seed=seed + 1, std=0.5, sort_names=True, **_LORA_CONFIG)


# -- building ------------------------------------------------------------------------------------


def _save_folder(out: Path, pipeline_fn: Any, kind: str, seed: int) -> Path:
    return build_folder(out, manifest_for(kind, seed), lambda tmp: pipeline_fn(seed).save_pretrained(tmp))


def _save_lora(out_root: Path, seed: int) -> Path:
    path = lora_path(out_root)

    def save(tmp: Path) -> None:
        from diffusers import SanaPipeline, SanaTransformer2DModel

        # The LoRA's shapes come from the saved transformer (the same weights components() draws).
        transformer = SanaTransformer2DModel.from_pretrained(out_root / BASE_NAME, subfolder="transformer")
        state_dict, config = lora_state_dict(transformer, seed)
        SanaPipeline.save_lora_weights(
            tmp,
            transformer_lora_layers=state_dict,
            weight_name=path.name,
            transformer_lora_adapter_metadata=config,
        )

    return build_file(path, _lora_manifest_path(out_root), manifest_for("lora", seed), save)


def build(out_root: str | os.PathLike[str], seed: int = 0) -> dict[str, Path]:
    """Build (or find built) the tiny Sana folders and LoRA under ``out_root``; paths by name."""
    root = Path(out_root)
    base = _save_folder(root / BASE_NAME, sana_pipeline, "pipeline", seed)
    controlnet = _save_folder(root / CONTROLNET_NAME, sana_controlnet_pipeline, "controlnet-pipeline", seed)
    lora = _save_lora(root, seed)
    return {BASE_NAME: base, CONTROLNET_NAME: controlnet, LORA_NAME: lora}


if __name__ == "__main__":
    import sys

    for name, p in build(sys.argv[1] if len(sys.argv) > 1 else "models").items():
        print(f"{name}\t{p}")
