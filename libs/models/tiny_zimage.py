"""Z-Image pipelines built from configs with random weights, for tests (no hub, no downloads).

``build(out_root)`` writes five things under ``out_root`` and returns their paths by name:

* ``tiny-zimage``: a ``ZImagePipeline`` folder (``save_pretrained`` layout: ``tokenizer``,
  ``text_encoder``, ``transformer``, ``vae``, ``scheduler``) whose scheduler shifts the schedule by
  resolution (``use_dynamic_shifting``: the pipeline's ``mu`` applies).
* ``tiny-zimage-turbo``: the *same* components (bit-identical weights) with a fixed-shift
  scheduler (``shift=3.0``, no dynamic shifting, so ``set_timesteps`` ignores ``mu``): our
  understanding of the Turbo checkpoint's scheduler config, not checked against the released file
  (built offline); it exercises the path where ``mu`` is ignored. One LoRA serves every folder.
* ``tiny-zimage-controlnet`` / ``tiny-zimage-turbo-controlnet``: ``ZImageControlNetPipeline``
  folders, the base and Turbo components plus ``controlnet``.
* ``tiny-zimage-style``: ``loras/tiny-zimage-style.safetensors``, a LoRA on the transformer's
  attention projections saved with ``ZImagePipeline.save_lora_weights``.

Every folder gets a manifest (``t2i-model.json``) written last, the LoRA a sidecar manifest
(``tiny-zimage-style.json``) after the file; an output whose manifest matches is left alone, so the
build is idempotent (the mechanics are :mod:`libs.models.build_utils`').

What the components are, and why (sizes after diffusers' own Z-Image pipeline tests):

* Tokenizer: a ``Qwen2Tokenizer`` (Qwen3's; transformers 5 builds it from an in-memory
  vocabulary): byte-level BPE with no merges over the 256 byte symbols, ``<|endoftext|>`` (id 0,
  also the padding token) and the chat markers ``<|im_start|>`` / ``<|im_end|>``. Its chat
  template (written here, in Qwen3's format) turns the one user message into
  ``<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n``, plus an empty think block when
  ``enable_thinking`` is false (``ZImagePipeline._encode_prompt`` passes true).
* Text encoder: a two-layer ``Qwen3Model`` (hidden size 16 = the transformer's ``cap_feat_dim``);
  the pipeline takes its second-to-last hidden state.
* Transformer: a ``ZImageTransformer2DModel`` with two main layers and one refiner layer of each
  kind (dim 32, 2 heads, RoPE axes 8/4/4), as in diffusers' tests; its ``x_pad_token`` and
  ``cap_pad_token`` are created by ``torch.empty``, so they are drawn here (uninitialised memory
  would make the weights, and the images, unrepeatable).
* VAE: an ``AutoencoderKL`` with four stages (``vae_scale_factor`` 8, as the Flux VAE that
  Z-Image uses) and 16 latent channels, with that VAE's ``scaling_factor`` and ``shift_factor``.
* ControlNet: a ``ZImageControlNetModel`` of the same dims with control blocks at main layers 0
  and 1 and ``control_in_dim`` 33 (the Union 2.0 layout: the 16 latent channels of the control
  image, zero-padded). Its ``before_proj`` / ``after_proj`` are zero-initialised by design (an
  untrained ControlNet is a no-op); they are re-drawn here, from a generator of their own, or the
  ControlNet image would equal the plain one. The pipeline shares the transformer's embedders,
  refiners and pad tokens with it (``from_transformer``), so the saved ``controlnet`` holds only
  its own weights: it is saved on its own and named in ``model_index.json``, not through the
  pipeline's ``save_pretrained`` (which would save the shared modules with it).
* LoRA: rank 4 with ``lora_alpha`` 4 on ``to_q``/``to_k``/``to_v``/``to_out.0`` of every attention,
  ``lora_B`` drawn at random (peft initialises it to zero, which would make the LoRA a no-op).
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
    randomize_,
    read_manifest,
    sidecar_path,
)

FAMILY = "zimage"
PRESET = "tiny"
BASE_NAME = "tiny-zimage"
TURBO_NAME = "tiny-zimage-turbo"
CONTROLNET_NAME = "tiny-zimage-controlnet"
TURBO_CONTROLNET_NAME = "tiny-zimage-turbo-controlnet"
LORA_NAME = "tiny-zimage-style"

_TEXT_DIM = 16  # Qwen3 hidden size = the transformer's cap_feat_dim
_LATENT_CHANNELS = 16
_LORA_RANK = 4
_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
_LORA_CONFIG = dict(r=_LORA_RANK, lora_alpha=_LORA_RANK, target_modules=_LORA_TARGETS, init_lora_weights=True)

_TRANSFORMER: dict[str, Any] = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=_LATENT_CHANNELS,
    dim=32,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=_TEXT_DIM,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[8, 4, 4],
    axes_lens=[1024, 128, 128],
)
_CONTROLNET: dict[str, Any] = dict(
    control_layers_places=[0, 1],
    control_in_dim=33,
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    dim=32,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
)
_FOLDERS = (
    (BASE_NAME, "pipeline", False, False),
    (TURBO_NAME, "turbo-pipeline", True, False),
    (CONTROLNET_NAME, "controlnet-pipeline", False, True),
    (TURBO_CONTROLNET_NAME, "turbo-controlnet-pipeline", True, True),
)

# Qwen3's chat format for the messages ZImagePipeline builds (one user turn, generation prompt).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
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
        all(read_manifest(root / name / MANIFEST) == manifest_for(kind, seed) for name, kind, *_ in _FOLDERS)
        and lora_path(root).is_file()
        and read_manifest(_lora_manifest_path(root)) == manifest_for("lora", seed)
    )


# -- components ----------------------------------------------------------------------------------


def qwen_tokenizer() -> Any:
    """A byte-level Qwen2 tokenizer with a chat template (see the module docstring)."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], chat_template=CHAT_TEMPLATE)
    tokenizer.add_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    return tokenizer


def components(seed: int = 0, *, turbo: bool = False) -> dict[str, Any]:
    """A pipeline's components, weights drawn from ``torch.manual_seed(seed)`` (the same for
    ``turbo``, which only changes the scheduler)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=_TEXT_DIM,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=0,
            eos_token_id=0,
        )
    )
    transformer = ZImageTransformer2DModel(**_TRANSFORMER)
    with torch.no_grad():  # torch.empty at init (see the module docstring)
        transformer.x_pad_token.normal_(0.0, 1.0)
        transformer.cap_pad_token.normal_(0.0, 1.0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[32, 32, 32, 32],
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=32,
        sample_size=64,
        scaling_factor=0.3611,  # the Flux VAE's, as Z-Image's
        shift_factor=0.1159,
    )
    if turbo:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder.eval(),
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "scheduler": scheduler,
    }


def controlnet_model(seed: int = 0) -> Any:
    """The ControlNet, drawn from ``torch.manual_seed(seed + 2)``, its zero projections re-drawn."""
    import torch
    from diffusers import ZImageControlNetModel

    torch.manual_seed(seed + 2)
    controlnet = ZImageControlNetModel(**_CONTROLNET)
    projections = [
        p
        for block in controlnet.control_layers
        for name in ("before_proj", "after_proj")
        if hasattr(block, name)
        for p in getattr(block, name).parameters()
    ]
    randomize_(projections, seed=seed + 3, std=0.3)
    return controlnet.eval()


def zimage_pipeline(seed: int = 0, *, turbo: bool = False) -> Any:
    from diffusers import ZImagePipeline

    return ZImagePipeline(**components(seed, turbo=turbo))


def _save_pipeline(tmp: Path, seed: int, turbo: bool, controlnet: bool) -> None:
    """``save_pretrained`` of the (Turbo) pipeline; with ``controlnet``, the ControlNet saved on its
    own beside it and ``model_index.json`` made a ``ZImageControlNetPipeline``'s."""
    import json

    zimage_pipeline(seed, turbo=turbo).save_pretrained(tmp)
    if controlnet:
        controlnet_model(seed).save_pretrained(tmp / "controlnet")
        index_path = tmp / "model_index.json"
        index = json.loads(index_path.read_text())
        index["_class_name"] = "ZImageControlNetPipeline"
        index["controlnet"] = ["diffusers", "ZImageControlNetModel"]
        index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")


def lora_state_dict(transformer: Any, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random non-zero LoRA for ``transformer`` (left unchanged): (peft state dict, LoraConfig dict)."""
    import copy

    return random_lora_(copy.deepcopy(transformer), seed=seed + 1, std=0.5, sort_names=True, **_LORA_CONFIG)


# -- building ------------------------------------------------------------------------------------


def _save_lora(out_root: Path, seed: int) -> Path:
    path = lora_path(out_root)

    def save(tmp: Path) -> None:
        from diffusers import ZImagePipeline, ZImageTransformer2DModel

        transformer = ZImageTransformer2DModel.from_pretrained(out_root / BASE_NAME, subfolder="transformer")
        state_dict, config = lora_state_dict(transformer, seed)
        ZImagePipeline.save_lora_weights(
            tmp,
            transformer_lora_layers=state_dict,
            weight_name=path.name,
            transformer_lora_adapter_metadata=config,
        )

    return build_file(path, _lora_manifest_path(out_root), manifest_for("lora", seed), save)


def build(out_root: str | os.PathLike[str], seed: int = 0) -> dict[str, Path]:
    """Build (or find built) the tiny Z-Image folders and LoRA under ``out_root``; paths by name."""
    root = Path(out_root)
    built: dict[str, Path] = {}
    for name, kind, turbo, controlnet in _FOLDERS:

        def save(tmp: Path, turbo: bool = turbo, controlnet: bool = controlnet) -> None:
            _save_pipeline(tmp, seed, turbo, controlnet)

        built[name] = build_folder(root / name, manifest_for(kind, seed), save)
    built[LORA_NAME] = _save_lora(root, seed)
    return built


if __name__ == "__main__":
    import sys

    for name, p in build(sys.argv[1] if len(sys.argv) > 1 else "models").items():
        print(f"{name}\t{p}")
