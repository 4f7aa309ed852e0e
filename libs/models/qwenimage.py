"""The Qwen-Image model family as ModelFns: diffusers' ``QwenImagePipeline.__call__`` and
``QwenImageEditPipeline.__call__`` cut at their seams.

Each class mirrors one stretch of ``diffusers/pipelines/qwenimage/pipeline_qwenimage.py`` or
``pipeline_qwenimage_edit.py`` (diffusers 0.42.1) and runs it on its own, so a workflow of these
nodes reproduces the monolithic pipelines' images bitwise. The ControlNet pipeline's own stretches
are :mod:`libs.models.qwenimage_controlnet`'s; the nodes of the pipelines that start from pictures
(img2img, inpainting and the instruction edits' image encoders and VL prompt encoders) are
:mod:`libs.models.qwenimage_img2img`'s.

===============================  ================================================================
ModelFn (``fn_name``)            what it mirrors
===============================  ================================================================
``qwenimage.text_encoder``       ``encode_prompt`` + ``_get_qwen_prompt_embeds`` (Qwen2.5-VL used as
                                 an encoder: last hidden state, template tokens dropped), prompt and
                                 negative prompt
``qwenimage.prepare_latents``    step 4 ``prepare_latents`` (noise, 2x2 packing) and step 5 (sigmas,
                                 ``calculate_shift``'s ``mu``, ``retrieve_timesteps``); with
                                 ``generator_state`` bound, the noise continues the ControlNet
                                 encoder's generator
``qwenimage.transformer``        the loop body up to ``noise_pred``: the conditional pass, the
                                 unconditional one and the true-CFG combination with its norm
                                 rescaling; with ``image_latents`` bound, the edit's concatenation;
                                 with ``controlnet_block_samples`` bound (a callback input, fetched
                                 inside the forward), the ControlNet's residuals in both passes
``qwenimage.scheduler_step``     the loop's ``self.scheduler.step(noise_pred, t, latents)``, stateless
``qwenimage.vae_decode``         the tail: ``_unpack_latents`` (5-D), latents mean/std, ``decode``
===============================  ================================================================

The denoising loop is the workflow's. Batch size and ``num_images_per_prompt`` are 1; user-supplied
embeddings/latents, custom ``sigmas``, callbacks and guidance-distilled transformers
(``guidance_embeds``, refused at load) are not mirrored. Decisions as the pipelines take them:

* True CFG iff ``true_cfg_scale > 1`` and a negative prompt is given (``do_true_cfg``). A workflow
  always passes its ``negative_prompt`` (default ``""``), so here it is ``true_cfg_scale > 1``; the
  text encoder leaves the negative embeddings empty otherwise.
* ``encode_prompt`` drops a mask of all ones (``prompt_embeds_mask = None``), which a single prompt
  always has; the nodes carry the mask and the transformer applies that rule.
* ``max_sequence_length`` truncates the prompt embeddings in ``QwenImagePipeline.encode_prompt``
  only; the edit pipeline's ``encode_prompt`` ignores it (checked, at most 1024, by both).
* The edits: the pictures' packed latents follow the noise in the transformer's sequence,
  ``img_shapes`` lists every grid (``image_shape`` has a row per picture) and the prediction is cut
  back to the noise's tokens.

Stateless scheduler step: ``FlowMatchEulerDiscreteScheduler``'s sigmas are a function of
``(num_inference_steps, mu)`` and ``mu`` of the packed sequence length ``latents.shape[1]``, so
``qwenimage.scheduler_step`` rebuilds a fresh scheduler per call with step 5's ``set_timesteps``
arguments, checks the carried ``timesteps`` and pins ``set_begin_index(step)``.

LoRA. ``qwenimage.transformer`` takes ``lora`` (a safetensors path, "" = none) and ``lora_scale``;
a :class:`~libs.models.lora.LoraSwitch` loads adapters as ``QwenImageLoraLoaderMixin
.load_lora_weights`` does (its ``lora_state_dict``, the file's adapter metadata, no network alphas)
and sets the scale with ``set_adapters``, never fusing.

Loading (:mod:`libs.models.qwenimage_loading`): the transformer's RoPE tables are recomputed on the
CPU (they are no checkpoint tensors), and the edit's VL processor is built without its video half
where torchvision is missing.

Dtypes follow the pipelines as loaded by ``from_pretrained`` without ``torch_dtype``: the noise and
the VAE input image take the text encoder's dtype (``prompt_embeds.dtype``), read from its config.
Noise is drawn on the CPU from ``torch.Generator("cpu").manual_seed(seed)``, its only draw (the
edit's VAE encoding takes the latent distribution's mode and draws nothing) except in the ControlNet
pipeline, which samples the control image's posterior first (``generator_state``).

No torch, diffusers or transformers at import time; ``load_model`` puts models on its ``device``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libs.models.common import (
    config_dtype,
    lazy_list,
    load_component,
    run_dtype,
    to_uint8_image,
    with_loads,
)
from libs.models.lora import LoraSwitch
from libs.models.qwenimage_latents import (
    _check_max_sequence_length,
    _do_true_cfg,
    _latent_size,
    _latents_stats,
    _pack_latents,
    _scheduler,
    _set_timesteps,
    _template,
    _unpack_latents,
    _vae_config,
    _vae_scale_factor,
)
from libs.models.qwenimage_loading import rope_tables_on_cpu
from libs.models.stepcache import step_cache
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch


# -- helpers -------------------------------------------------------------------------------------


def _masked_embeds(hidden_states: torch.Tensor, mask: torch.Tensor, drop_idx: int) -> torch.Tensor:
    """``_extract_masked_hidden`` then the template drop, for one prompt."""
    import torch

    bool_mask = mask.bool()
    (kept,) = torch.split(hidden_states[bool_mask], bool_mask.sum(dim=1).tolist(), dim=0)
    return kept[drop_idx:]


def _embeds_and_mask(kept: torch.Tensor, dtype: Any, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The stack/pad tail of ``_get_qwen_prompt_embeds`` for one prompt: [1, L, D] and its mask."""
    import torch

    embeds = torch.stack([kept]).to(dtype=dtype, device=device)
    mask = torch.stack([torch.ones(kept.size(0), dtype=torch.long, device=kept.device)])
    return embeds, mask


def _empty_embeds(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return like.new_zeros((1, 0, like.shape[-1])), torch.zeros((1, 0), dtype=torch.long)


def _lora_loader(path: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """``QwenImageLoraLoaderMixin.load_lora_weights``' reading of a file, for ``LoraSwitch``."""
    from diffusers import QwenImagePipeline

    state_dict, metadata = QwenImagePipeline.lora_state_dict(path, return_lora_metadata=True)
    if not all("lora" in key for key in state_dict):
        raise ValueError(
            "Invalid LoRA checkpoint. Make sure all LoRA param names contain `'lora'` substring."
        )
    # load_lora_into_transformer: network_alphas=None, the metadata, low_cpu_mem_usage as defaulted
    return state_dict, "transformer", dict(network_alphas=None, metadata=metadata, low_cpu_mem_usage=True)


# -- the ModelFns --------------------------------------------------------------------------------


class QwenImageTextEncoder(ModelFn):
    """Qwen2.5-VL prompt encoding (``QwenImagePipeline.encode_prompt``): ``prompt_embeds`` [1, L, D],
    ``prompt_embeds_mask`` [1, L] and the negative prompt's (empty [1, 0, ...] without true CFG)."""

    fn_name = "qwenimage.text_encoder"
    pipeline = "QwenImagePipeline"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_input("negative_prompt")
        self.add_input("true_cfg_scale")
        self.add_input("max_sequence_length")
        self.add_output("prompt_embeds")
        self.add_output("prompt_embeds_mask")
        self.add_output("negative_prompt_embeds")
        self.add_output("negative_prompt_embeds_mask")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        template, drop_idx, tokenizer_max_length = _template(self.pipeline)
        return with_loads(
            {
                "tokenizer": AutoTokenizer.from_pretrained(model_path, subfolder="tokenizer"),
                "text_encoder": load_component(
                    Qwen2_5_VLForConditionalGeneration, model_path, "text_encoder", device, loader
                ),
                "template": template,
                "drop_idx": drop_idx,
                "tokenizer_max_length": tokenizer_max_length,
            }
        )

    def _encode(self, components: dict[str, Any], prompt: str, max_length: int, image: Any) -> Any:
        """``_get_qwen_prompt_embeds`` then ``encode_prompt``'s truncation."""
        tokenizer, text_encoder = components["tokenizer"], components["text_encoder"]
        drop_idx = components["drop_idx"]
        txt = [components["template"].format(prompt)]
        tokens = tokenizer(
            txt,
            max_length=components["tokenizer_max_length"] + drop_idx,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(text_encoder.device)
        out = text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        )
        kept = _masked_embeds(out.hidden_states[-1], tokens.attention_mask, drop_idx)
        embeds, mask = _embeds_and_mask(kept, text_encoder.dtype, text_encoder.device)
        return embeds[:, :max_length], mask[:, :max_length]

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        max_length = _check_max_sequence_length(inputs["max_sequence_length"])
        image = inputs.get("image")
        with torch.no_grad():
            embeds, mask = self._encode(components, str(inputs["prompt"]), max_length, image)
            if _do_true_cfg(inputs["true_cfg_scale"]):
                negative = str(inputs.get("negative_prompt") or "")
                neg_embeds, neg_mask = self._encode(components, negative, max_length, image)
            else:
                neg_embeds, neg_mask = _empty_embeds(embeds)
        return {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "negative_prompt_embeds": neg_embeds,
            "negative_prompt_embeds_mask": neg_mask,
        }


class QwenImagePrepareLatents(ModelFn):
    """Initial noise and schedule: ``latents`` [1, seq, 4C] (packed) and ``timesteps``. Configs only.

    ``generator_state`` (optional): the request generator's state after ``qwenimage.control_encode``
    sampled from it; when bound, the noise continues from it (the ControlNet pipeline's draw order)
    instead of from a generator freshly seeded with ``seed``."""

    fn_name = "qwenimage.prepare_latents"

    def setup_io(self) -> None:
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_input("generator_state", optional=True)
        self.add_output("latents")
        self.add_output("timesteps")
        self.add_output("cache_state")  # the first step's step-cache state: none (libs.models.stepcache)

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

        transformer_config = QwenImageTransformer2DModel.load_config(model_path, subfolder="transformer")
        return {
            "num_channels_latents": int(transformer_config["in_channels"]) // 4,
            "vae_scale_factor": _vae_scale_factor(_vae_config(model_path)),
            "scheduler_config": FlowMatchEulerDiscreteScheduler.load_config(
                model_path, subfolder="scheduler"
            ),
            # prepare_latents(..., prompt_embeds.dtype, ...): the text encoder's dtype
            "dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
        }

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        steps = int(inputs["num_inference_steps"])
        if steps < 1:
            raise ValueError(f"num_inference_steps must be at least 1, got {steps}")
        height, width = _latent_size(inputs["height"], inputs["width"], components["vae_scale_factor"])
        channels = components["num_channels_latents"]
        with torch.no_grad():
            # 4. prepare_latents: [1, 1, C, H, W] drawn (after the ControlNet's sample), then packing
            generator = torch.Generator(device="cpu")
            state = inputs.get("generator_state")
            if state is None:
                generator.manual_seed(int(inputs["seed"]))
            else:
                generator.set_state(state.to(device="cpu", dtype=torch.uint8).contiguous())
            noise = randn_tensor(
                (1, 1, channels, height, width),
                generator=generator,
                device=torch.device("cpu"),
                dtype=components["dtype"],
            )
            latents = _pack_latents(noise, channels, height, width)
            # 5. timesteps, on a scheduler of our own
            scheduler = _scheduler(components["scheduler_config"])
            _set_timesteps(scheduler, steps, latents.shape[1], device="cpu")
        return {"latents": latents, "timesteps": scheduler.timesteps, "cache_state": []}


class QwenImageTransformer(ModelFn):
    """One denoising step with true CFG: ``noise_pred`` shaped like ``latents``. With the edit's
    ``image_latents`` and ``image_shape`` bound, the image tokens follow the noise and are cut off
    the prediction. ``controlnet_block_samples`` (callback) is handed to both passes' forward.
    The loop body of ``QwenImageControlNetPipeline`` is the same but for that argument."""

    fn_name = "qwenimage.transformer"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("height")
        self.add_input("width")
        self.add_input("true_cfg_scale")
        self.add_input("prompt_embeds")
        self.add_input("prompt_embeds_mask")
        self.add_input("negative_prompt_embeds")
        self.add_input("negative_prompt_embeds_mask")
        self.add_input("image_latents", optional=True)
        self.add_input("image_shape", optional=True)
        self.add_input("controlnet_block_samples", callback=True, optional=True)
        self.add_input("lora", optional=True)
        self.add_input("lora_scale", optional=True)
        self.add_input("cache", optional=True)
        self.add_input("cache_threshold", optional=True)
        self.add_input("cache_state", optional=True)
        self.add_output("noise_pred")
        self.add_output("cache_state")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import QwenImageTransformer2DModel

        with rope_tables_on_cpu():
            transformer = load_component(
                QwenImageTransformer2DModel, model_path, "transformer", device, loader
            )
        if transformer.config.guidance_embeds:
            raise ValueError("qwenimage.transformer: guidance-distilled transformers are not supported")
        factor = _vae_scale_factor(_vae_config(model_path))
        return with_loads(
            {
                "transformer": transformer,
                "vae_scale_factor": factor,
                "lora": LoraSwitch(transformer, _lora_loader),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        transformer, factor = components["transformer"], components["vae_scale_factor"]
        device = transformer.device
        lora_scale = inputs.get("lora_scale")
        components["lora"].use(inputs.get("lora") or None, 1.0 if lora_scale is None else float(lora_scale))
        latents = inputs["latents"].to(device)
        height, width = int(inputs["height"]), int(inputs["width"])
        img_shapes = [(1, height // factor // 2, width // factor // 2)]
        latent_model_input = latents
        image_latents = inputs.get("image_latents")
        if image_latents is not None:
            latent_model_input = torch.cat([latents, image_latents.to(device)], dim=1)
            # one (height, width) row per picture (an old single-picture [2] reads as one row)
            img_shapes += [(1, int(ih), int(iw)) for ih, iw in inputs["image_shape"].reshape(-1, 2).tolist()]
        true_cfg_scale = float(inputs["true_cfg_scale"])
        block_samples = lazy_list(
            inputs.get("controlnet_block_samples"), lambda samples: [x.to(device) for x in samples]
        )
        control = {} if block_samples is None else {"controlnet_block_samples": block_samples}

        def mask_of(mask: torch.Tensor) -> torch.Tensor | None:
            return None if mask.all() else mask.to(device)  # encode_prompt drops an all-ones mask

        with torch.no_grad():
            # 6. Denoising loop body
            t = inputs["timesteps"].to(device)[int(inputs["step"])]
            timestep = t.expand(latents.shape[0]).to(latents.dtype)

            def forward(embeds: torch.Tensor, mask: torch.Tensor, context: str) -> torch.Tensor:
                with transformer.cache_context(context):
                    out = transformer(
                        hidden_states=latent_model_input,
                        timestep=timestep / 1000,
                        guidance=None,
                        encoder_hidden_states_mask=mask_of(mask),
                        encoder_hidden_states=embeds.to(device),
                        img_shapes=[img_shapes],
                        attention_kwargs={},
                        return_dict=False,
                        **control,
                    )[0]
                return out[:, : latents.size(1)] if image_latents is not None else out

            out: dict[str, Any] = {}
            with step_cache(transformer, inputs, out):  # both passes, each in its cache context
                noise_pred = forward(inputs["prompt_embeds"], inputs["prompt_embeds_mask"], "cond")
                if _do_true_cfg(true_cfg_scale):
                    neg = forward(
                        inputs["negative_prompt_embeds"], inputs["negative_prompt_embeds_mask"], "uncond"
                    )
            if _do_true_cfg(true_cfg_scale):
                comb_pred = neg + true_cfg_scale * (noise_pred - neg)
                cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
                noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
                noise_pred = comb_pred * (cond_norm / noise_norm)
            out["noise_pred"] = noise_pred
        return out


class QwenImageSchedulerStep(ModelFn):
    """One flow-matching Euler step, stateless: ``latents`` of step ``step + 1``."""

    fn_name = "qwenimage.scheduler_step"

    def setup_io(self) -> None:
        self.add_input("noise_pred")
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("num_inference_steps")
        self.add_output("latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = dict(FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler"))
        _scheduler(config)  # refuse a stochastic one at load time
        return {"scheduler_config": config}

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        latents = inputs["latents"]
        noise_pred = inputs["noise_pred"].to(latents.device)
        step, steps = int(inputs["step"]), int(inputs["num_inference_steps"])
        with torch.no_grad():
            scheduler = _scheduler(components["scheduler_config"])
            _set_timesteps(scheduler, steps, latents.shape[1], device=latents.device)
            timesteps = inputs["timesteps"].to(latents.device)
            if not torch.equal(scheduler.timesteps, timesteps):
                raise ValueError(
                    f"timesteps do not match a {steps}-step schedule for {latents.shape[1]} latent tokens"
                )
            if not 0 <= step < len(timesteps):
                raise ValueError(f"step {step} is outside the {len(timesteps)}-step schedule")
            scheduler.set_begin_index(step)
            # compute the previous noisy sample x_t -> x_t-1
            latents = scheduler.step(noise_pred, timesteps[step], latents, return_dict=False)[0]
        return {"latents": latents}


class QwenImageVaeDecode(ModelFn):
    """Latents to pixels (``AutoencoderKLQwenImage``, 5-D): ``image``, a uint8 [H, W, 3] tensor equal
    to ``np.array`` of the pipeline's PIL image."""

    fn_name = "qwenimage.vae_decode"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("height")
        self.add_input("width")
        self.add_output("image")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKLQwenImage
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKLQwenImage, model_path, "vae", device, loader)
        factor = _vae_scale_factor(vae.config)
        return with_loads(
            {
                "vae": vae,
                "vae_scale_factor": factor,
                "image_processor": VaeImageProcessor(vae_scale_factor=factor * 2),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        with torch.no_grad():
            # the tail of __call__
            latents = _unpack_latents(
                inputs["latents"], int(inputs["height"]), int(inputs["width"]), components["vae_scale_factor"]
            )
            latents = latents.to(device=vae.device, dtype=vae.dtype)
            mean, std = _latents_stats(vae.config, latents)
            latents = latents / (1.0 / std) + mean
            image = vae.decode(latents, return_dict=False)[0][:, :, 0]
            return {"image": to_uint8_image(image_processor, image)}
