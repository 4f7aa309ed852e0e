"""Flux pipelines built from configs with random weights, for tests and CPU benchmarks (no hub).

``build_flux(out_dir, preset, seed)`` builds a ``FluxPipeline`` from the configs below, seeds torch
first so the weights are a function of ``seed``, saves it with ``save_pretrained`` (the layout every
``load_model`` reads) and writes a manifest, ``t2i-model.json``, last. A folder whose manifest
matches is complete and is not rebuilt; the build goes to a temporary sibling folder that is
renamed into place, so an interrupted build never looks complete.

Tokenizers are built from in-memory vocabularies (transformers 5 needs no downloaded files):

* CLIP: a byte-level BPE with no merges over single characters, each with a word-final ``</w>``
  twin; lower-case letters, digits and common punctuation (CLIP lower-cases its input).
  Ids 0/1 are ``<|startoftext|>``/``<|endoftext|>``, matching the text config's bos/eos (CLIP pools
  at the eos id).
* T5: a Unigram vocabulary of ``<pad>``, ``</s>``, ``<unk>`` (ids 0/1/2, as the T5 config expects),
  then word-initial pieces ``▁c`` and inner pieces ``c`` for letters of both cases, digits and
  punctuation.

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

import json
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

FAMILY = "flux"
MANIFEST = "t2i-model.json"
PRESETS = ("tiny", "bench")

# Characters the tiny tokenizers know; anything else becomes the unknown token.
_PUNCTUATION = ".,!?'-:;()&/\"#+*%$@"
_CLIP_CHARS = string.ascii_lowercase + string.digits + _PUNCTUATION
_T5_CHARS = string.ascii_letters + string.digits + _PUNCTUATION

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


# -- manifest ------------------------------------------------------------------------------------


def manifest_for(preset: str, seed: int) -> dict[str, Any]:
    return {"preset": preset, "seed": int(seed), "family": FAMILY}


def write_manifest(out_dir: str | os.PathLike[str], preset: str, seed: int) -> Path:
    """Mark ``out_dir`` as a complete build of ``preset``/``seed``; call after everything else."""
    path = Path(out_dir) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest_for(preset, seed), indent=2) + "\n")
    tmp.replace(path)
    return path


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a built folder, or None if there is none (or it is unreadable)."""
    try:
        data = json.loads((Path(out_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_built(out_dir: str | os.PathLike[str], preset: str = "tiny", seed: int = 0) -> bool:
    return read_manifest(out_dir) == manifest_for(preset, seed)


# -- components ----------------------------------------------------------------------------------


def clip_tokenizer() -> Any:
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CLIP_CHARS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer() -> Any:
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    vocab += [("▁" + c, -1.0) for c in _T5_CHARS]
    vocab += [(c, -2.0) for c in _T5_CHARS]
    return T5TokenizerFast(vocab=vocab, extra_ids=0)


def flux_pipeline(preset: str = "tiny", seed: int = 0) -> Any:
    """A ``FluxPipeline`` of ``preset`` with weights drawn from ``torch.manual_seed(seed)``."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
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
    transformer = FluxTransformer2DModel(**_TRANSFORMERS[preset])
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


def build_flux(out_dir: str | os.PathLike[str], preset: str = "tiny", seed: int = 0) -> Path:
    """Build and save a Flux pipeline folder at ``out_dir``; a no-op if it is already built."""
    out = Path(out_dir)
    if is_built(out, preset, seed):
        return out
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        flux_pipeline(preset, seed).save_pretrained(tmp)
        write_manifest(tmp, preset, seed)  # last: the folder is complete
        tmp.chmod(0o755)  # mkdtemp made it private
        if out.exists():
            if is_built(out, preset, seed):  # a concurrent build finished first
                return out
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
