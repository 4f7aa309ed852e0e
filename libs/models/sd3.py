"""The Stable Diffusion 3 family as ModelFns: diffusers' SD3 pipelines cut at their seams.

Each class mirrors one stretch of ``StableDiffusion3Pipeline.__call__``
(``diffusers/pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py``, diffusers 0.42.1; "SD3"
below) or of ``StableDiffusion3ControlNetPipeline.__call__``
(``diffusers/pipelines/controlnet_sd3/pipeline_stable_diffusion_3_controlnet.py``; "CN"), so a
workflow of these nodes reproduces the monolithic pipeline's image bitwise. The ControlNet-only nodes,
``sd3.control_image`` and ``sd3.controlnet``, live in :mod:`libs.models.sd3_controlnet`:

===========================  ====================================================================
ModelFn (``fn_name``)        what it mirrors
===========================  ====================================================================
``sd3.clip_encoder``         ``_get_clip_prompt_embeds`` for CLIP-L and CLIP-G and their
                             concatenation in ``encode_prompt`` (prompt and negative prompt)
``sd3.t5_encoder``           ``_get_t5_prompt_embeds``, called by ``encode_prompt`` for both prompts
``sd3.join_prompt_embeds``   ``encode_prompt``'s zero-padding of the CLIP embeddings to T5's width
                             and the sequence concatenation
``sd3.prepare_latents``      step 4 ``prepare_latents`` and step 5, the timesteps
``sd3.transformer``          one denoising step up to the guided ``noise_pred`` (SD3's loop body;
                             with ``block_controlnet_hidden_states``: CN's)
``sd3.flow_match_step``      the loop's ``self.scheduler.step(noise_pred, t, latents)`` line
``sd3.vae_decode``           the tail: scale/shift, ``vae.decode``, postprocess
===========================  ====================================================================

Classifier-free guidance is batched ``[uncond, cond]`` exactly as the pipeline batches it (SD3 step 3,
``torch.cat([negative_prompt_embeds, prompt_embeds])``): ``guidance_scale > 1`` makes every embedding
node emit a batch of two, negative first, and the transformer node doubles the latents, runs one
batched forward and applies ``u + g * (c - u)``. Batch size and ``num_images_per_prompt`` are 1 (the
platform never batches requests: batching changes the bits). ``prompt_2``/``prompt_3`` are the prompt,
as when the pipeline is called without them; clip skip, skip-layer guidance, IP-Adapter and step
callbacks are not mirrored.

The SD3 transformer takes the raw timestep (Flux divides it by 1000; SD3 does not). The flow-match
Euler step is stateless: ``sd3.flow_match_step`` rebuilds a fresh scheduler per call with the pipeline's
``set_timesteps`` arguments (``mu`` only if the scheduler config asks for dynamic shifting, as in SD3's
step 5; SD3-medium and SD3.5 do not), checks them against the carried ``timesteps`` and pins the index
with ``set_begin_index(step)``: bitwise equal to the pipeline's stateful scheduler.

ControlNet residuals (the paper, §5.2). ``sd3.transformer`` declares ``sd3.controlnet``'s output
``control_block_samples`` as an optional callback input: in a ControlNet workflow it arrives as a
:class:`~libs.workflow.modelfn.Deferred` and is handed to the transformer as a lazy list
(:func:`~libs.models.common.lazy_list`), so the fetch happens when the transformer's block loop first
adds a control residual (after its first joint block), not before the forward starts.

LoRA. ``sd3.transformer`` takes optional ``lora`` (a safetensors path, ``""`` = none) and
``lora_scale`` inputs and switches adapters with :class:`~libs.models.lora.LoraSwitch` (never fused), as
``pipe.load_lora_weights(path)`` + ``pipe.set_adapters([name], [scale])`` would apply them to the
transformer. Only transformer LoRAs are served (text-encoder parts would need the encoder nodes too).

Dtypes follow the pipeline as loaded by ``from_pretrained`` without ``torch_dtype``: transformers models
at the dtype saved in their config, diffusers models at fp32. Values that depend on a component another
node owns are read from that component's config: both CLIP hidden states are cast to CLIP-L's dtype
(``_get_clip_prompt_embeds`` uses ``self.text_encoder.dtype`` for both) and the noise takes
``prompt_embeds.dtype`` (the promotion of the CLIP and T5 dtypes by ``torch.cat``).

This module imports no torch, diffusers or transformers at import time: the registry reads
``signature()`` of these classes in a process without torch. ``load_model`` puts the models on the
device it is given; the noise nodes draw on the CPU, as the pipeline's CPU generator does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from libs.models.common import (
    calculate_shift,
    config_dtype,
    lazy_list,
    load_component,
    run_dtype,
    to_uint8_image,
    vae_scale_factor,
    with_loads,
)
from libs.workflow.modelfn import ModelFn

# -- helpers ---------------------------------------------------------------------------------------


def _has_component(model_path: str, name: str) -> bool:
    """Whether the pipeline folder has ``name`` (SD3 may be saved with ``text_encoder_3=None``)."""
    try:
        index = json.loads((Path(model_path) / "model_index.json").read_text())
    except (OSError, ValueError):
        return (Path(model_path) / name).is_dir()
    entry = index.get(name)
    return isinstance(entry, list) and entry[0] is not None


def _do_cfg(guidance_scale: float) -> bool:
    # StableDiffusion3Pipeline.do_classifier_free_guidance: guidance_scale = 1 means no CFG
    return float(guidance_scale) > 1


def _set_sd3_timesteps(
    scheduler: Any, num_inference_steps: int, latent_shape: Any, patch_size: int, device: Any
) -> None:
    """SD3 step 5: ``retrieve_timesteps`` without sigmas, i.e. ``set_timesteps(n, device=...,
    [mu=...])``, ``mu`` only under dynamic shifting (note SD3's default ``max_shift`` 1.16; Flux's
    is 1.15)."""
    kwargs: dict[str, Any] = {}
    config = scheduler.config
    if config.get("use_dynamic_shifting", None):
        height, width = int(latent_shape[-2]), int(latent_shape[-1])
        kwargs["mu"] = calculate_shift(
            (height // patch_size) * (width // patch_size),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.16),
        )
    scheduler.set_timesteps(int(num_inference_steps), device=device, **kwargs)


def _check_lora_metadata(path: str, metadata: dict[str, Any] | None) -> None:
    """Refuse adapters whose saved config :func:`_load_sd3_lora` would not reproduce.

    The loader hands ``LoraSwitch`` the state dict without the file's adapter metadata, so
    ``load_lora_adapter`` infers ``lora_alpha = r`` per module (``get_peft_kwargs``); the pipeline's
    ``load_lora_weights`` uses the metadata. They agree exactly when the metadata says the same."""
    if not metadata:
        return
    config = {k.removeprefix("transformer."): v for k, v in metadata.items() if k.startswith("transformer.")}
    if not config:
        return
    r, alpha = config.get("r"), config.get("lora_alpha")
    alpha_pattern, rank_pattern = config.get("alpha_pattern") or {}, config.get("rank_pattern") or {}
    if alpha != r or alpha_pattern != rank_pattern or config.get("use_rslora"):
        raise ValueError(
            f"LoRA {path}: its metadata sets lora_alpha={alpha}, r={r}, alpha_pattern={alpha_pattern}, "
            f"use_rslora={config.get('use_rslora')}; LoraSwitch loads adapters without metadata (alpha = r), "
            "so this adapter would not match the pipeline"
        )


def _load_sd3_lora(path: str) -> tuple[dict[str, Any], str | None]:
    """A LoRA file as ``SD3LoraLoaderMixin.load_lora_weights`` reads it, for ``LoraSwitch``."""
    from diffusers.loaders import SD3LoraLoaderMixin

    state_dict, metadata = SD3LoraLoaderMixin.lora_state_dict(path, return_lora_metadata=True)
    if not all("lora" in key for key in state_dict):  # load_lora_weights' format check
        raise ValueError(f"Invalid LoRA checkpoint {path}: every parameter name must contain 'lora'.")
    others = sorted({key.split(".", 1)[0] for key in state_dict} - {"transformer"})
    if others:
        raise ValueError(f"LoRA {path} also adapts {others}; only transformer LoRAs are served")
    _check_lora_metadata(path, metadata)
    return state_dict, "transformer"


# -- text encoders -------------------------------------------------------------------------------


class SD3ClipEncoder(ModelFn):
    """CLIP-L and CLIP-G: ``clip_prompt_embeds`` [B, 77, d_L + d_G] (penultimate hidden states,
    concatenated) and ``pooled_prompt_embeds`` [B, p_L + p_G]; B = 2 ([negative, prompt]) under CFG."""

    fn_name = "sd3.clip_encoder"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_input("negative_prompt")
        self.add_input("guidance_scale")
        self.add_output("clip_prompt_embeds")
        self.add_output("pooled_prompt_embeds")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        encoders: list[Any] = [
            load_component(CLIPTextModelWithProjection, model_path, sub, device, loader)
            for sub in ("text_encoder", "text_encoder_2")
        ]
        return with_loads(
            {
                "tokenizers": [
                    CLIPTokenizer.from_pretrained(model_path, subfolder="tokenizer"),
                    CLIPTokenizer.from_pretrained(model_path, subfolder="tokenizer_2"),
                ],
                "text_encoders": encoders,
            }
        )

    @staticmethod
    def _clip_embeds(components: dict[str, Any], prompt: str, index: int) -> tuple[Any, Any]:
        """``_get_clip_prompt_embeds(prompt, clip_model_index=index)``, clip_skip None."""
        tokenizer = components["tokenizers"][index]
        text_encoder = components["text_encoders"][index]
        # tokenizer_max_length is the *first* tokenizer's model_max_length, for both CLIPs (SD3 __init__)
        max_length = components["tokenizers"][0].model_max_length
        text_input_ids = tokenizer(
            [prompt], padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
        ).input_ids
        out = text_encoder(text_input_ids.to(text_encoder.device), output_hidden_states=True)
        pooled_prompt_embeds = out[0]
        # both CLIPs are cast to text_encoder's (CLIP-L's) dtype
        prompt_embeds = out.hidden_states[-2].to(dtype=components["text_encoders"][0].dtype)
        return prompt_embeds, pooled_prompt_embeds

    def _encode(self, components: dict[str, Any], prompt: str) -> tuple[Any, Any]:
        import torch

        prompt_embed, pooled_prompt_embed = self._clip_embeds(components, prompt, 0)
        prompt_2_embed, pooled_prompt_2_embed = self._clip_embeds(components, prompt, 1)
        clip_prompt_embeds = torch.cat([prompt_embed, prompt_2_embed], dim=-1)
        pooled_prompt_embeds = torch.cat([pooled_prompt_embed, pooled_prompt_2_embed], dim=-1)
        return clip_prompt_embeds, pooled_prompt_embeds

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        with torch.no_grad():
            clip_prompt_embeds, pooled_prompt_embeds = self._encode(components, inputs["prompt"])
            if _do_cfg(inputs["guidance_scale"]):
                negative_prompt = inputs["negative_prompt"] or ""  # encode_prompt's default
                negative_clip, negative_pooled = self._encode(components, negative_prompt)
                # SD3 step 3: [negative, prompt] along the batch
                clip_prompt_embeds = torch.cat([negative_clip, clip_prompt_embeds], dim=0)
                pooled_prompt_embeds = torch.cat([negative_pooled, pooled_prompt_embeds], dim=0)
        return {"clip_prompt_embeds": clip_prompt_embeds, "pooled_prompt_embeds": pooled_prompt_embeds}


class SD3T5Encoder(ModelFn):
    """T5: ``t5_prompt_embeds`` [B, max_sequence_length, d_T5]; B = 2 ([negative, prompt]) under CFG.
    Zeros of the transformer's ``joint_attention_dim`` when the pipeline has no T5
    (``_get_t5_prompt_embeds``)."""

    fn_name = "sd3.t5_encoder"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_input("negative_prompt")
        self.add_input("guidance_scale")
        self.add_input("max_sequence_length")
        self.add_output("t5_prompt_embeds")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        import torch
        from diffusers import SD3Transformer2DModel
        from transformers import T5EncoderModel, T5TokenizerFast  # type: ignore[attr-defined]

        if not _has_component(model_path, "text_encoder_3"):
            config = SD3Transformer2DModel.load_config(model_path, subfolder="transformer")
            return {
                "text_encoder_3": None,
                "joint_attention_dim": int(config["joint_attention_dim"]),
                # dtype or self.text_encoder.dtype
                "dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
                "device": torch.device(device),  # where the zeros go (the pipeline's execution device)
            }
        text_encoder_3: Any = load_component(T5EncoderModel, model_path, "text_encoder_3", device, loader)
        return with_loads(
            {
                "tokenizer_3": T5TokenizerFast.from_pretrained(model_path, subfolder="tokenizer_3"),
                "text_encoder_3": text_encoder_3,
            }
        )

    @staticmethod
    def _t5_embeds(components: dict[str, Any], prompt: str, max_sequence_length: int) -> Any:
        """``_get_t5_prompt_embeds``."""
        import torch

        text_encoder_3 = components["text_encoder_3"]
        if text_encoder_3 is None:
            shape = (1, max_sequence_length, components["joint_attention_dim"])
            return torch.zeros(shape, device=components["device"], dtype=components["dtype"])
        text_input_ids = components["tokenizer_3"](
            [prompt],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).input_ids
        prompt_embeds = text_encoder_3(text_input_ids.to(text_encoder_3.device))[0]
        return prompt_embeds.to(dtype=text_encoder_3.dtype)

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        max_sequence_length = int(inputs["max_sequence_length"])
        if max_sequence_length > 512:  # check_inputs
            raise ValueError(f"`max_sequence_length` cannot be greater than 512 but is {max_sequence_length}")
        with torch.no_grad():
            t5_prompt_embeds = self._t5_embeds(components, inputs["prompt"], max_sequence_length)
            if _do_cfg(inputs["guidance_scale"]):
                negative_prompt = inputs["negative_prompt"] or ""
                negative = self._t5_embeds(components, negative_prompt, max_sequence_length)
                t5_prompt_embeds = torch.cat([negative, t5_prompt_embeds], dim=0)  # SD3 step 3
        return {"t5_prompt_embeds": t5_prompt_embeds}


class SD3JoinPromptEmbeds(ModelFn):
    """``prompt_embeds`` [B, 77 + max_sequence_length, d_T5]: the CLIP embeddings zero-padded to T5's
    width, followed by T5's along the sequence (``encode_prompt``). Pure data movement: no weights."""

    fn_name = "sd3.join_prompt_embeds"

    def setup_io(self) -> None:
        self.add_input("clip_prompt_embeds")
        self.add_input("t5_prompt_embeds")
        self.add_output("prompt_embeds")

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        clip_prompt_embeds, t5_prompt_embeds = inputs["clip_prompt_embeds"], inputs["t5_prompt_embeds"]
        clip_prompt_embeds = clip_prompt_embeds.to(t5_prompt_embeds.device)
        with torch.no_grad():
            # Row i of a batched pad/cat is the pad/cat of row i: the [negative, prompt] batch built by the
            # encoders equals the pipeline's per-prompt joins concatenated in its step 3.
            clip_prompt_embeds = torch.nn.functional.pad(
                clip_prompt_embeds, (0, t5_prompt_embeds.shape[-1] - clip_prompt_embeds.shape[-1])
            )
            prompt_embeds = torch.cat([clip_prompt_embeds, t5_prompt_embeds], dim=-2)
        return {"prompt_embeds": prompt_embeds}


# -- latents, denoiser, scheduler, decoder --------------------------------------------------------


class SD3PrepareLatents(ModelFn):
    """Initial noise ``latents`` [1, C, H/f, W/f] and ``timesteps`` [num_inference_steps] (fp32).
    Needs configs only, no weights."""

    fn_name = "sd3.prepare_latents"

    def setup_io(self) -> None:
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_output("latents")
        self.add_output("timesteps")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        import torch
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        transformer_config = SD3Transformer2DModel.load_config(model_path, subfolder="transformer")
        clip_dtype = config_dtype(model_path, "text_encoder", run_dtype(loader))
        t5_dtype = (
            config_dtype(model_path, "text_encoder_3", run_dtype(loader))
            if _has_component(model_path, "text_encoder_3")
            else clip_dtype
        )
        return {
            "num_channels_latents": int(transformer_config["in_channels"]),
            "patch_size": int(transformer_config["patch_size"]),
            "vae_scale_factor": vae_scale_factor(AutoencoderKL.load_config(model_path, subfolder="vae")),
            "scheduler_config": FlowMatchEulerDiscreteScheduler.load_config(
                model_path, subfolder="scheduler"
            ),
            # prepare_latents draws in prompt_embeds.dtype: torch.cat's promotion of CLIP's and T5's
            "latents_dtype": torch.promote_types(clip_dtype, t5_dtype),
        }

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        seed, steps = int(inputs["seed"]), int(inputs["num_inference_steps"])
        height, width = int(inputs["height"]), int(inputs["width"])
        factor = components["vae_scale_factor"]
        multiple = factor * components["patch_size"]
        if height % multiple or width % multiple:  # check_inputs
            raise ValueError(
                f"`height` and `width` have to be divisible by {multiple} but are {height} and {width}."
            )
        shape = (1, components["num_channels_latents"], height // factor, width // factor)
        with torch.no_grad():
            # 4. prepare_latents: randn_tensor with a CPU generator samples on the CPU
            generator = torch.Generator(device="cpu").manual_seed(seed)
            latents = torch.randn(shape, generator=generator, device="cpu", dtype=components["latents_dtype"])
            # 5. timesteps, on a scheduler of our own
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
            _set_sd3_timesteps(scheduler, steps, latents.shape, components["patch_size"], device="cpu")
        return {"latents": latents, "timesteps": scheduler.timesteps}


class SD3Transformer(ModelFn):
    """One denoising step of the SD3 transformer with CFG: the guided ``noise_pred`` [1, C, h, w].

    ``control_block_samples`` (optional callback) are a ControlNet's block samples of this step;
    ``lora``/``lora_scale`` (optional) select an adapter for this call."""

    fn_name = "sd3.transformer"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("prompt_embeds")
        self.add_input("pooled_prompt_embeds")
        self.add_input("control_block_samples", callback=True, optional=True)
        self.add_input("lora", optional=True)
        self.add_input("lora_scale", optional=True)
        self.add_output("noise_pred")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import SD3Transformer2DModel

        from libs.models.lora import LoraSwitch

        transformer = load_component(SD3Transformer2DModel, model_path, "transformer", device, loader)
        return with_loads({"transformer": transformer, "loras": LoraSwitch(transformer, _load_sd3_lora)})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        transformer = components["transformer"]
        device = transformer.device
        # Every call selects its adapter, so a warm instance never leaks one request's LoRA into the next.
        components["loras"].use(inputs.get("lora") or None, float(inputs.get("lora_scale", 1.0)))
        # Fetched when the block loop first reads it (after joint block 0), not now.
        control = lazy_list(
            inputs.get("control_block_samples"), lambda samples: [s.to(device) for s in samples]
        )
        guidance_scale = float(inputs["guidance_scale"])
        latents = inputs["latents"].to(device)
        with torch.no_grad():
            # expand the latents if we are doing classifier free guidance
            latent_model_input = torch.cat([latents] * 2) if _do_cfg(guidance_scale) else latents
            t = inputs["timesteps"].to(device)[int(inputs["step"])]
            timestep = t.expand(latent_model_input.shape[0])  # SD3 does not divide by 1000
            noise_pred = transformer(
                hidden_states=latent_model_input,
                timestep=timestep,
                encoder_hidden_states=inputs["prompt_embeds"].to(device),
                pooled_projections=inputs["pooled_prompt_embeds"].to(device),
                block_controlnet_hidden_states=control,
                joint_attention_kwargs=None,
                return_dict=False,
            )[0]
            if _do_cfg(guidance_scale):  # perform guidance
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        return {"noise_pred": noise_pred}


class SD3FlowMatchStep(ModelFn):
    """One flow-matching Euler step, stateless: ``latents`` of step ``step + 1``."""

    fn_name = "sd3.flow_match_step"

    def setup_io(self) -> None:
        self.add_input("noise_pred")
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("num_inference_steps")
        self.add_output("latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        transformer_config = SD3Transformer2DModel.load_config(model_path, subfolder="transformer")
        return {
            "scheduler_config": FlowMatchEulerDiscreteScheduler.load_config(
                model_path, subfolder="scheduler"
            ),
            "patch_size": int(transformer_config["patch_size"]),
        }

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        latents = inputs["latents"]
        noise_pred = inputs["noise_pred"].to(latents.device)
        step, steps = int(inputs["step"]), int(inputs["num_inference_steps"])
        with torch.no_grad():
            # A fresh scheduler in the state the pipeline's is in at iteration `step`.
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
            _set_sd3_timesteps(
                scheduler, steps, latents.shape, components["patch_size"], device=latents.device
            )
            timesteps = inputs["timesteps"].to(latents.device)
            if not torch.equal(scheduler.timesteps, timesteps):
                raise ValueError(
                    f"timesteps do not match a {steps}-step schedule for latents of {tuple(latents.shape)}"
                )
            scheduler.set_begin_index(step)
            # compute the previous noisy sample x_t -> x_t-1
            latents = scheduler.step(noise_pred, timesteps[step], latents, return_dict=False)[0]
        return {"latents": latents}


class SD3VaeDecode(ModelFn):
    """Latents to pixels: ``image``, a uint8 [H, W, 3] tensor equal to ``np.array`` of the pipeline's
    PIL image."""

    fn_name = "sd3.vae_decode"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_output("image")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
        return with_loads(
            {"vae": vae, "image_processor": VaeImageProcessor(vae_scale_factor=vae_scale_factor(vae.config))}
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        with torch.no_grad():
            latents = (inputs["latents"].to(vae.device) / vae.config.scaling_factor) + vae.config.shift_factor
            image = vae.decode(latents, return_dict=False)[0]
            return {"image": to_uint8_image(image_processor, image)}
