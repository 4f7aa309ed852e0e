"""Flux.2 Klein pipelines built from configs with random weights, for tests (no hub, no downloads).

``build(out_root)`` writes two things under ``out_root`` and returns their paths by name:

* ``tiny-flux2-klein``: a ``Flux2KleinPipeline`` folder (``save_pretrained`` layout: ``tokenizer``,
  ``text_encoder``, ``transformer``, ``vae``, ``scheduler``), ``is_distilled=False`` (a Klein *base*
  checkpoint, so ``guidance_scale > 1`` runs classifier-free guidance).
* ``tiny-flux2-style``: ``loras/tiny-flux2-style.safetensors``, a LoRA on the transformer saved
  with ``Flux2KleinPipeline.save_lora_weights`` and its adapter metadata.

The folder's manifest (``t2i-model.json``) is written last and the LoRA's sidecar manifest
(``tiny-flux2-style.t2i-lora.json``) after the file; a piece whose manifest matches is left alone,
so the build is idempotent (:mod:`libs.models.build_utils`). Weights are a function of ``seed``.

The components, shaped like diffusers' own Flux.2 Klein tests except where noted:

* Tokenizer: a ``Qwen2TokenizerFast`` (transformers 5: the ``tokenizers``-backed class both Qwen2
  names point at) over an in-memory byte-level vocabulary with no merges: the 256 byte symbols of
  GPT-2's byte-to-unicode table, then ``<|endoftext|>`` (Qwen's pad/eos), ``<|im_start|>``,
  ``<|im_end|>``, ``<think>`` and ``</think>`` as special tokens. Its chat template renders the
  ChatML turns Qwen3 uses, and with ``enable_thinking=False`` the empty think block, which is what
  ``_get_qwen3_prompt_embeds`` asks for. Any text tokenizes (one token per byte).
* Text encoder: a ``Qwen3ForCausalLM`` of hidden size 16 with 27 layers, so the pipeline's default
  ``text_encoder_out_layers=(9, 18, 27)`` applies unchanged (diffusers' tests use 2 layers and pass
  ``(1,)``); the layers are tiny, the whole model has 0.1 M parameters.
* Transformer: a ``Flux2Transformer2DModel`` of 1 double and 2 single blocks (2 heads of 16,
  ``joint_attention_dim`` 48 = three stacked hidden states of 16, no guidance embedding as in Klein),
  ``in_channels`` 16 = 4 latent channels x the 2x2 patch.
* VAE: an ``AutoencoderKLFlux2`` with two blocks (scale factor 2) and 4 latent channels. Its batch
  norm's running statistics are the latents' normalisation, which ``flux2.vae_decode`` undoes; fresh
  ones are mean 0 / variance 1, so they are re-drawn here (a test would not see them otherwise).
* Scheduler: ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting (FLUX.2-klein's config), so
  ``mu`` from ``compute_empirical_mu`` matters.
* LoRA: rank 4, alpha 8 on the double blocks' attention projections and the single blocks' fused
  ``to_qkv_mlp_proj``, ``lora_B`` drawn at random (peft initialises it to zero, a no-op).
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

FAMILY = "flux2"
PRESET = "tiny"
BASE_NAME = "tiny-flux2-klein"
LORA_NAME = "tiny-flux2-style"
LORA_MANIFEST_SUFFIX = ".t2i-lora.json"

_TEXT_DIM = 16
_TEXT_LAYERS = 27  # hidden_states[27] is the last one the pipeline's default stacks
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=3 * _TEXT_DIM,
    timestep_guidance_channels=256,
    axes_dims_rope=[4, 4, 4, 4],
    guidance_embeds=False,
)
_LORA_CONFIG: dict[str, Any] = dict(
    r=4,
    lora_alpha=8,
    init_lora_weights=True,
    target_modules=[
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_qkv_mlp_proj",
    ],
)


# -- manifest ------------------------------------------------------------------------------------


def manifest_for(kind: str, seed: int) -> dict[str, Any]:
    return {"family": FAMILY, "kind": kind, "preset": PRESET, "seed": int(seed)}


def lora_path(out_root: str | os.PathLike[str]) -> Path:
    return Path(out_root) / "loras" / f"{LORA_NAME}.safetensors"


def _lora_manifest_path(out_root: str | os.PathLike[str]) -> Path:
    return sidecar_path(lora_path(out_root), LORA_MANIFEST_SUFFIX)


def is_built(out_root: str | os.PathLike[str], seed: int = 0) -> bool:
    root = Path(out_root)
    return read_manifest(root / BASE_NAME / MANIFEST) == manifest_for("pipeline", seed) and read_manifest(
        _lora_manifest_path(root)
    ) == manifest_for("lora", seed)


# -- components ----------------------------------------------------------------------------------


def qwen_tokenizer() -> Any:
    """The in-memory byte-level Qwen tokenizer (see the module docstring)."""
    from tokenizers import AddedToken
    from transformers import Qwen2TokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab: dict[str, int] = {}
    for symbol in bytes_to_unicode().values():
        vocab[symbol] = len(vocab)
    for token in _SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=[], chat_template=_CHAT_TEMPLATE, model_max_length=512)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS[1:]])
    return tokenizer


def components(seed: int = 0) -> dict[str, Any]:
    """Every component of the pipeline, weights drawn from ``torch.manual_seed(seed)``."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=_TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=_TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
    )
    transformer = Flux2Transformer2DModel(**_TRANSFORMER)
    vae = AutoencoderKLFlux2(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=_TRANSFORMER["in_channels"] // 4,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    randomize_([vae.bn.running_mean], seed=seed + 2, std=0.5)
    with torch.no_grad():
        vae.bn.running_var.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(seed + 3))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        base_shift=0.5,
        max_shift=1.15,
    )
    return {
        "scheduler": scheduler,
        "vae": vae.eval(),
        "text_encoder": text_encoder.eval(),
        "tokenizer": tokenizer,
        "transformer": transformer.eval(),
    }


def flux2_klein_pipeline(seed: int = 0, is_distilled: bool = False) -> Any:
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline(**components(seed), is_distilled=is_distilled)


def lora_state_dict(transformer: Any, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random non-zero LoRA for ``transformer`` (left unchanged): (peft state dict, metadata)."""
    import copy

    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state_dict, config = random_lora_(copy.deepcopy(transformer), seed=seed + 1, std=0.5, **_LORA_CONFIG)
    # Sets (target_modules) become sorted lists: save_lora_weights would list them in hash order.
    return state_dict, {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


# -- building ------------------------------------------------------------------------------------


def _save_lora(out_root: Path, seed: int) -> Path:
    path = lora_path(out_root)

    def save(tmp: Path) -> None:
        from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

        transformer = Flux2Transformer2DModel.from_pretrained(out_root / BASE_NAME, subfolder="transformer")
        state_dict, metadata = lora_state_dict(transformer, seed)
        Flux2KleinPipeline.save_lora_weights(
            tmp,
            transformer_lora_layers=state_dict,
            weight_name=path.name,
            transformer_lora_adapter_metadata=metadata,
        )

    return build_file(path, _lora_manifest_path(out_root), manifest_for("lora", seed), save)


def build(out_root: str | os.PathLike[str], seed: int = 0) -> dict[str, Path]:
    """Build (or find built) the tiny Flux.2 Klein folder and LoRA under ``out_root``; paths by name."""
    root = Path(out_root)
    base = build_folder(
        root / BASE_NAME,
        manifest_for("pipeline", seed),
        lambda tmp: flux2_klein_pipeline(seed).save_pretrained(tmp),
    )
    return {BASE_NAME: base, LORA_NAME: _save_lora(root, seed)}


if __name__ == "__main__":
    import sys

    for name, p in build(sys.argv[1] if len(sys.argv) > 1 else "models").items():
        print(f"{name}\t{p}")
