"""The tiny Flux pipeline that :mod:`libs.trained.train` trains on the shapes data set.

A plain ``FluxPipeline`` (schnell-style: no guidance embedding, no dynamic shifting), so the
platform's ``flux.*`` ModelFns serve it unchanged:

* ``transformer``: ``FluxTransformer2DModel`` with 2 double + 3 single blocks, 3 heads of 32
  (width 96), RoPE axes (8, 12, 12), 16 input channels (4 latent channels, 2x2 packed);
* ``vae``: ``AutoencoderKL`` with blocks (16, 32, 32), i.e. a 4x compression: a 64x64 picture is
  a 4x16x16 latent, 8x8 = 64 packed tokens; its ``scaling_factor`` / ``shift_factor`` are set from
  the latent statistics after training;
* ``text_encoder``: the tiny families' CLIP (hidden 32, character tokenizer of
  :func:`libs.models.build_utils.clip_tokenizer`), random and frozen (its pooled output is a fixed
  feature of the caption);
* ``text_encoder_2``: a T5 encoder (d_model 32, 2 layers), random and frozen, with a word-level
  tokenizer (:func:`t5_tokenizer`): every word of the caption grammar is one piece, other text
  falls back to characters;
* ``scheduler``: ``FlowMatchEulerDiscreteScheduler`` with :data:`SHIFT`, no dynamic shifting.

No torch at import time.
"""

from __future__ import annotations

from typing import Any

from libs.models import build_utils
from libs.trained import shapes

TEXT_DIM = 32
MAX_SEQUENCE_LENGTH = 16  # the grammar's captions are 10-11 T5 tokens with </s>
SHIFT = 1.0  # the scheduler's shift (see docs/trained-model.md for the sweep)
TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=3,
    attention_head_dim=32,
    num_attention_heads=3,
    joint_attention_dim=TEXT_DIM,
    pooled_projection_dim=TEXT_DIM,
    axes_dims_rope=[8, 12, 12],
    guidance_embeds=False,
)
VAE_BLOCKS = (16, 32, 32)


def grammar_words() -> list[str]:
    """Every word a caption of :mod:`libs.trained.shapes` uses, in a fixed order."""
    words = ["a", "two", "on", "a", "background"]
    words += [w for s in shapes.SHAPES for w in (s, s + "s")]
    words += list(shapes.COLOURS) + list(shapes.BACKGROUNDS)
    words += [w for phrase, _ in shapes.POSITIONS.values() for w in phrase.split()]
    return list(dict.fromkeys(words))


def t5_tokenizer() -> Any:
    """The tiny families' T5 Unigram vocabulary plus one piece per grammar word (scored above
    any spelling of it in characters, so a grammar word is one token)."""
    from transformers import T5TokenizerFast

    chars = build_utils._T5_CHARS  # noqa: SLF001 - the tiny families' character set
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    vocab += [("▁" + w, -0.5) for w in grammar_words() if len(w) > 1]
    vocab += [("▁" + c, -1.0) for c in chars]
    vocab += [(c, -2.0) for c in chars]
    return T5TokenizerFast(vocab=vocab, extra_ids=0)


def scheduler(shift: float = SHIFT) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=False)


def pipeline(seed: int) -> Any:
    """The untrained pipeline, every weight drawn from ``torch.manual_seed(seed)`` in a fixed order."""
    import torch
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = build_utils.clip_tokenizer(), t5_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer.get_vocab()),
            hidden_size=TEXT_DIM,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            max_position_embeddings=77,
            projection_dim=TEXT_DIM,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2.get_vocab()),
            d_model=TEXT_DIM,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    transformer = FluxTransformer2DModel(**TRANSFORMER)
    vae = AutoencoderKL(
        sample_size=shapes.SIZE,
        in_channels=3,
        out_channels=3,
        block_out_channels=VAE_BLOCKS,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_BLOCKS),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0,
        scaling_factor=1.0,
    )
    return FluxPipeline(
        scheduler=scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
