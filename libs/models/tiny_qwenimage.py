"""Qwen-Image pipelines built from configs with random weights, for tests (no hub, no downloads).

``build(out_root)`` writes four things under ``out_root`` and returns their paths by name:

* ``tiny-qwenimage``: a ``QwenImagePipeline`` folder (``save_pretrained`` layout: ``tokenizer``,
  ``text_encoder``, ``transformer``, ``vae``, ``scheduler``).
* ``tiny-qwenimage-edit``: a ``QwenImageEditPipeline`` folder with the *same* components
  (bit-identical weights, so one LoRA serves both) plus ``processor``: the VL processor's tokenizer
  and image processor, as ``Qwen2VLProcessor.save_pretrained`` writes them less the video
  processor (which needs torchvision; :func:`libs.models.qwenimage.vl_processor` reads the folder).
* ``tiny-qwenimage-controlnet``: a ``QwenImageControlNetPipeline`` folder, the base components
  (bit-identical) plus ``controlnet``.
* ``tiny-qwenimage-style``: ``loras/tiny-qwenimage-style.safetensors``, a LoRA on the
  transformer's attention projections saved with ``QwenImagePipeline.save_lora_weights``.

Manifests (``t2i-model.json``, the LoRA's sidecar) are written last and an output whose manifest
matches is left alone, so the build is idempotent (:mod:`libs.models.build_utils`).

The components, sized as diffusers' own QwenImage tests size theirs, but built here from nothing:

* Tokenizer: a ``Qwen2Tokenizer`` over the 256 byte-level symbols with no merges (every byte one
  token, so any prompt encodes), ``<|endoftext|>`` at id 0 and Qwen's chat and vision tokens
  (``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
  ``<|video_pad|>``) as special tokens after them.
* Text encoder: a ``Qwen2_5_VLForConditionalGeneration`` (2 text layers of width 16 with M-RoPE
  sections (1, 1, 2); a 2-block vision tower of width 16), its image/vision token ids those of the
  tokenizer.
* Image processor: ``Qwen2VLImageProcessor`` with at most 112x112 pixels, so an edit's 1024x1024
  prompt image is 16 vision tokens after merging.
* Transformer: a 2-block ``QwenImageTransformer2DModel`` (3 heads of 16, RoPE axes (8, 4, 4),
  joint dim 16 = the text width, 16 packed input channels = 4 latent channels x 2x2).
* VAE: an ``AutoencoderKLQwenImage`` with ``z_dim`` 4, base width 8 and three downsamplings
  (``vae_scale_factor`` 8, so the edit's 1024x1024 input is 64x64 packed tokens), and non-trivial
  ``latents_mean``/``latents_std`` so the (un)normalisation is exercised.
* ControlNet: a 1-block ``QwenImageControlNetModel`` of the transformer's width, so its one block
  sample is added after both transformer blocks (the forward's ``interval_control`` is 2). Its
  ``controlnet_blocks`` and ``controlnet_x_embedder`` are zero-initialised by design (a fresh
  ControlNet changes nothing) and re-drawn here, or the ControlNet tests would prove nothing.
* Scheduler: ``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's dynamic shifting settings.
* LoRA: rank 4, ``lora_alpha`` 4 on ``to_q``/``to_k``/``to_v``/``to_out.0`` and the text stream's
  ``add_q_proj``/``add_k_proj``/``add_v_proj``/``to_add_out``; ``lora_B`` drawn at random (peft's
  zeros would make it a no-op).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from libs.models.build_utils import (
    MANIFEST,
    build_file,
    build_folder,
    random_lora_,
    randomize_,
    read_manifest,
    sidecar_path,
)

FAMILY = "qwenimage"
PRESET = "tiny"
BASE_NAME = "tiny-qwenimage"
EDIT_NAME = "tiny-qwenimage-edit"
CONTROLNET_NAME = "tiny-qwenimage-controlnet"
LORA_NAME = "tiny-qwenimage-style"

_TEXT_DIM = 16
_Z_DIM = 4
_LORA_RANK = 4
_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
_LORA_CONFIG = dict(r=_LORA_RANK, lora_alpha=_LORA_RANK, target_modules=_LORA_TARGETS, init_lora_weights=True)
_SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_TRANSFORMER: dict[str, Any] = dict(
    patch_size=2,
    in_channels=_Z_DIM * 4,
    out_channels=_Z_DIM,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=3,
    joint_attention_dim=_TEXT_DIM,
    guidance_embeds=False,
    axes_dims_rope=(8, 4, 4),
)
_CONTROLNET: dict[str, Any] = {
    **{k: v for k, v in _TRANSFORMER.items() if k != "guidance_embeds"},
    "num_layers": 1,
    "extra_condition_channels": 0,
}
_VAE: dict[str, Any] = dict(
    base_dim=8,
    z_dim=_Z_DIM,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.1, -0.2, 0.3, 0.0],
    latents_std=[1.5, 0.8, 1.2, 1.0],
)
_SCHEDULER: dict[str, Any] = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=8192,
    max_shift=0.9,
    shift=1.0,
    shift_terminal=0.02,
    use_dynamic_shifting=True,
    time_shift_type="exponential",
)


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
        and read_manifest(root / EDIT_NAME / MANIFEST) == manifest_for("edit-pipeline", seed)
        and read_manifest(root / CONTROLNET_NAME / MANIFEST) == manifest_for("controlnet-pipeline", seed)
        and lora_path(root).is_file()
        and read_manifest(_lora_manifest_path(root)) == manifest_for("lora", seed)
    )


# -- components ----------------------------------------------------------------------------------


def qwen_tokenizer() -> Any:
    """A byte-level Qwen2 tokenizer with Qwen's special tokens (see the module docstring)."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=[], additional_special_tokens=_SPECIAL_TOKENS)


def image_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)


def components(seed: int = 0) -> dict[str, Any]:
    """The base pipeline's components, weights drawn from ``torch.manual_seed(seed)``."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    ids = dict(zip(_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(_SPECIAL_TOKENS), strict=True))
    vocab_size = len(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=_TEXT_DIM,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            rope_theta=1000000.0,
            vocab_size=vocab_size,
            bos_token_id=0,
            eos_token_id=0,
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=_TEXT_DIM
        ),
        hidden_size=_TEXT_DIM,
        vocab_size=vocab_size,
        bos_token_id=0,
        eos_token_id=0,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    transformer = QwenImageTransformer2DModel(**_TRANSFORMER)
    vae = AutoencoderKLQwenImage(**_VAE)
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(**_SCHEDULER),
        "vae": vae.eval(),
        "text_encoder": text_encoder.eval(),
        "tokenizer": tokenizer,
        "transformer": transformer.eval(),
    }


def qwenimage_pipeline(seed: int = 0) -> Any:
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**components(seed))


def controlnet_model(seed: int = 0) -> Any:
    """The ControlNet, drawn from ``torch.manual_seed(seed + 2)``, its zero layers re-drawn."""
    import torch
    from diffusers import QwenImageControlNetModel

    torch.manual_seed(seed + 2)
    controlnet = QwenImageControlNetModel(**_CONTROLNET)
    zeroed = [*controlnet.controlnet_blocks.parameters(), *controlnet.controlnet_x_embedder.parameters()]
    randomize_(zeroed, seed=seed + 3, std=0.3)
    return controlnet.eval()


def lora_state_dict(transformer: Any, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random non-zero LoRA for ``transformer`` (left unchanged): (peft state dict, LoraConfig dict)."""
    import copy

    state_dict, config = random_lora_(
        copy.deepcopy(transformer), seed=seed + 1, std=0.5, sort_names=True, **_LORA_CONFIG
    )
    # Sets (target_modules) become sorted lists: save_lora_weights would list them in hash order.
    return state_dict, {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


# -- building ------------------------------------------------------------------------------------


def _save_base(tmp: Path, seed: int) -> None:
    qwenimage_pipeline(seed).save_pretrained(tmp)


def _save_edit(tmp: Path, seed: int) -> None:
    """The base folder plus ``processor``, its ``model_index.json`` naming the edit pipeline."""
    _save_base(tmp, seed)
    processor = tmp / "processor"
    qwen_tokenizer().save_pretrained(processor)
    image_processor().save_pretrained(processor)
    index_path = tmp / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = "QwenImageEditPipeline"
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


def _save_controlnet(tmp: Path, seed: int) -> None:
    from diffusers import QwenImageControlNetPipeline

    QwenImageControlNetPipeline(**components(seed), controlnet=controlnet_model(seed)).save_pretrained(tmp)


def _save_lora(out_root: Path, seed: int) -> Path:
    path = lora_path(out_root)

    def save(tmp: Path) -> None:
        from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

        transformer = QwenImageTransformer2DModel.from_pretrained(
            out_root / BASE_NAME, subfolder="transformer"
        )
        state_dict, config = lora_state_dict(transformer, seed)
        QwenImagePipeline.save_lora_weights(
            tmp,
            transformer_lora_layers=state_dict,
            weight_name=path.name,
            transformer_lora_adapter_metadata=config,
        )

    return build_file(path, _lora_manifest_path(out_root), manifest_for("lora", seed), save)


def build(out_root: str | os.PathLike[str], seed: int = 0) -> dict[str, Path]:
    """Build (or find built) the tiny Qwen-Image folders and LoRA under ``out_root``; paths by name."""
    root = Path(out_root)
    base = build_folder(root / BASE_NAME, manifest_for("pipeline", seed), lambda tmp: _save_base(tmp, seed))
    edit = build_folder(
        root / EDIT_NAME, manifest_for("edit-pipeline", seed), lambda tmp: _save_edit(tmp, seed)
    )
    controlnet = build_folder(
        root / CONTROLNET_NAME,
        manifest_for("controlnet-pipeline", seed),
        lambda tmp: _save_controlnet(tmp, seed),
    )
    lora = _save_lora(root, seed)
    return {BASE_NAME: base, EDIT_NAME: edit, CONTROLNET_NAME: controlnet, LORA_NAME: lora}


if __name__ == "__main__":
    import sys

    for name, p in build(sys.argv[1] if len(sys.argv) > 1 else "models").items():
        print(f"{name}\t{p}")
