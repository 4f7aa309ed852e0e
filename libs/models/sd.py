"""The Stable Diffusion 1.5 family as ModelFns: ``StableDiffusionPipeline.__call__`` and
``StableDiffusionControlNetPipeline.__call__`` cut at their seams, with classifier-free guidance.

Each class mirrors one stretch of ``diffusers/pipelines/stable_diffusion/pipeline_stable_diffusion.py``
("SD" below) or ``diffusers/pipelines/controlnet/pipeline_controlnet.py`` ("CN"), diffusers 0.42.1,
so a workflow of these nodes reproduces the monolithic pipeline's image bitwise. The ControlNet-only
nodes, ``sd.control_image`` and ``sd.controlnet``, live in :mod:`libs.models.sd_controlnet`:

=========================  ========================================================================
ModelFn (``fn_name``)      what it mirrors
=========================  ========================================================================
``sd.text_encoder``        step 3: ``encode_prompt`` (prompt, then negative prompt: two CLIP passes)
                           and the CFG layout ``torch.cat([negative_prompt_embeds, prompt_embeds])``
``sd.prepare_latents``     step 4 ``retrieve_timesteps`` and step 5 ``prepare_latents`` (noise from
                           ``torch.Generator().manual_seed(seed)``, times ``init_noise_sigma``)
``sd.unet``                one loop iteration up to the guided ``noise_pred`` (both pipelines)
``sd.ddim_step``           the loop's ``self.scheduler.step(noise_pred, t, latents, eta=0)`` line
``sd.vae_decode``          the tail: ``vae.decode(latents / scaling_factor)``, postprocess
=========================  ========================================================================

The denoising loop is the workflow's: per step, ``sd.unet`` (and, in parallel, ``sd.controlnet``)
then ``sd.ddim_step``. Batch size and ``num_images_per_prompt`` are 1 (batching changes bits).
Not mirrored: IP-Adapter, ``timestep_cond`` UNets (LCM; rejected at load), ``clip_skip``,
``guidance_rescale`` (SD's default 0.0 skips it; CN has none), ``control_guidance_start/end``
(fixed at CN's defaults 0.0/1.0, kept in the ``controlnet_keep`` formula), multi-ControlNets, the
safety checker (the pipelines are built with ``safety_checker=None``, so ``do_denormalize`` is all
``True``), and text-encoder LoRA layers (a LoRA file holding any is rejected; see ``sd.unet``).

Scheduler. The workflow samples with DDIM at ``eta=0`` (the pipelines' default ``eta``), built
from the checkpoint's scheduler config as ``DDIMScheduler.from_config(pipe.scheduler.config)`` does,
after SD's ``__init__`` fix-ups of outdated configs (``steps_offset`` -> 1, ``clip_sample`` -> False;
CN's ``__init__`` lacks them, which matters only for such outdated configs). DDIM with ``eta=0`` is
stateless between steps: its only state is ``num_inference_steps`` (from ``set_timesteps``), its
``scale_model_input`` is the identity and ``init_noise_sigma`` is 1.0; it draws no noise, so the
pipeline's generator is used by ``prepare_latents`` alone. Each ``sd.ddim_step`` call rebuilds a fresh
scheduler with ``set_timesteps(num_inference_steps)`` and checks it against the carried ``timesteps``.
A PNDM checkpoint (SD1.5's default) thus gives the image of the pipeline with DDIM swapped in.

ControlNet (the paper, §5.2). ``sd.controlnet`` runs every step beside ``sd.unet``; both need only
the previous step's latents. ``sd.unet`` declares the ControlNet outputs as optional callback inputs,
so the same class serves both workflows: when bound, they arrive as ``Deferred`` and are handed to the
UNet as lazy stand-ins (:func:`~libs.models.common.lazy_list`,
:func:`~libs.models.common.lazy_addend`), so the fetch happens where ``UNet2DConditionModel.forward``
first consumes them (the ``zip`` after the down blocks, and ``sample + mid_block_additional_residual``
after the mid block).

Dtypes follow the pipelines as loaded by ``from_pretrained`` without ``torch_dtype``: the prompt
embeddings take the text encoder's dtype (``encode_prompt``), the noise the embeddings' dtype
(``prepare_latents(..., prompt_embeds.dtype, ...)``), the control image the ControlNet's dtype.

No torch, diffusers or transformers at import time: the registry reads ``signature()`` without
them. ``load_model`` puts the models on the device it is given; noise is drawn on the CPU, as the
pipeline's CPU generator does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libs.models.common import (
    config_dtype,
    lazy_addend,
    lazy_list,
    load_component,
    run_dtype,
    to_uint8_image,
    vae_scale_factor,
    with_loads,
)
from libs.models.lora import LoraSwitch
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch


# -- helpers -------------------------------------------------------------------------------------


def _scheduler_config(model_path: str) -> dict[str, Any]:
    """The checkpoint's scheduler config with ``StableDiffusionPipeline.__init__``'s fix-ups of
    outdated ``steps_offset`` and ``clip_sample``."""
    from diffusers import DDIMScheduler

    config = dict(DDIMScheduler.load_config(model_path, subfolder="scheduler"))
    if config.get("steps_offset", 1) != 1:
        config["steps_offset"] = 1
    if config.get("clip_sample", False) is True:
        config["clip_sample"] = False
    return config


def _ddim(config: dict[str, Any], num_inference_steps: int, device: Any) -> Any:
    """A fresh DDIM scheduler after ``retrieve_timesteps(scheduler, n, device)`` (no custom
    timesteps or sigmas: ``scheduler.set_timesteps(n, device=device)``)."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_config(config)
    scheduler.set_timesteps(int(num_inference_steps), device=device)
    return scheduler


def _do_classifier_free_guidance(guidance_scale: float, unet_config: Any) -> bool:
    # SD/CN property do_classifier_free_guidance
    return guidance_scale > 1 and unet_config.get("time_cond_proj_dim") is None


def _check_cfg_batch(prompt_embeds: torch.Tensor, latents: torch.Tensor, do_cfg: bool) -> None:
    if prompt_embeds.shape[0] != latents.shape[0] * (2 if do_cfg else 1):
        raise ValueError(
            f"prompt_embeds has batch {prompt_embeds.shape[0]} for latents of batch {latents.shape[0]}: "
            f"expected {'[negative, positive]' if do_cfg else 'the positive embeddings alone'} "
            "(were they encoded with the same guidance_scale?)"
        )


def _load_unet_lora(path: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """A LoRA file as SD's ``load_lora_weights`` reads it, for :class:`LoraSwitch`.

    ``lora_state_dict(path, return_lora_metadata=True)`` (which also converts kohya/A1111 files and
    returns their ``network_alphas``); ``load_lora_adapter`` then gets the state dict with
    ``prefix="unet"`` *and* the alphas/metadata, as ``load_lora_into_unet`` passes them
    (``lora_alpha`` lives in the metadata; without it the adapter's scaling would differ)."""
    from diffusers import StableDiffusionPipeline

    state_dict, network_alphas, metadata = StableDiffusionPipeline.lora_state_dict(
        path, return_lora_metadata=True
    )
    # load_lora_weights' format check
    if not all("lora" in key for key in state_dict):
        raise ValueError(
            "Invalid LoRA checkpoint. Make sure all LoRA param names contain `'lora'` substring."
        )
    if any(key.startswith("text_encoder.") for key in state_dict):
        raise ValueError(
            f"{path}: LoRA layers for the text encoder are not supported (sd.text_encoder has no adapters); "
            "only UNet LoRAs reproduce the pipeline's image"
        )
    if not any(key.startswith("unet.") for key in state_dict):
        raise ValueError(f"{path}: no UNet LoRA layers found")
    return state_dict, "unet", {"network_alphas": network_alphas, "metadata": metadata}


# -- the ModelFns --------------------------------------------------------------------------------


class SdTextEncoder(ModelFn):
    """CLIP text encoder: ``prompt_embeds`` [2, 77, hidden] = [negative, positive] with CFG
    (``guidance_scale > 1``), else [1, 77, hidden]."""

    fn_name = "sd.text_encoder"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_input("negative_prompt", optional=True)
        self.add_input("guidance_scale")
        self.add_output("prompt_embeds")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        tokenizer = CLIPTokenizer.from_pretrained(model_path, subfolder="tokenizer")
        text_encoder = load_component(CLIPTextModel, model_path, "text_encoder", device, loader)
        return with_loads(
            {
                "tokenizer": tokenizer,
                "text_encoder": text_encoder,
                "unet_config": UNet2DConditionModel.load_config(model_path, subfolder="unet"),
            }
        )

    def _encode(self, components: dict[str, Any], text: str, max_length: int) -> torch.Tensor:
        tokenizer, text_encoder = components["tokenizer"], components["text_encoder"]
        ids = tokenizer(
            text, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
        )
        attention_mask = None
        if getattr(text_encoder.config, "use_attention_mask", False):
            attention_mask = ids.attention_mask.to(text_encoder.device)
        return text_encoder(ids.input_ids.to(text_encoder.device), attention_mask=attention_mask)[0]

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        prompt: str = inputs["prompt"]
        negative_prompt = inputs.get("negative_prompt") or ""  # None and "" both encode [""]
        guidance_scale = float(inputs["guidance_scale"])
        tokenizer, text_encoder = components["tokenizer"], components["text_encoder"]
        dtype = text_encoder.dtype
        with torch.no_grad():
            # encode_prompt: the prompt padded to model_max_length ...
            prompt_embeds = self._encode(components, prompt, tokenizer.model_max_length)
            prompt_embeds = prompt_embeds.to(dtype=dtype)
            if not _do_classifier_free_guidance(guidance_scale, components["unet_config"]):
                return {"prompt_embeds": prompt_embeds}
            # ... then the negative prompt, separately, padded to the prompt's length
            negative_prompt_embeds = self._encode(components, negative_prompt, prompt_embeds.shape[1])
            negative_prompt_embeds = negative_prompt_embeds.to(dtype=dtype)
            # __call__: "we concatenate the unconditional and text embeddings into a single batch"
            prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds])
        return {"prompt_embeds": prompt_embeds}


class SdPrepareLatents(ModelFn):
    """Initial noise and schedule: ``latents`` [1, C, H/f, W/f] and ``timesteps`` [n] (int64).
    Needs configs only, no weights."""

    fn_name = "sd.prepare_latents"

    def setup_io(self) -> None:
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_output("latents")
        self.add_output("timesteps")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL, UNet2DConditionModel

        unet_config = UNet2DConditionModel.load_config(model_path, subfolder="unet")
        return {
            "num_channels_latents": int(unet_config["in_channels"]),
            "vae_scale_factor": vae_scale_factor(AutoencoderKL.load_config(model_path, subfolder="vae")),
            "scheduler_config": _scheduler_config(model_path),
            # prepare_latents draws in prompt_embeds.dtype, i.e. the text encoder's
            "latents_dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
        }

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        seed, steps = int(inputs["seed"]), int(inputs["num_inference_steps"])
        height, width = int(inputs["height"]), int(inputs["width"])
        if height % 8 != 0 or width % 8 != 0:  # SD check_inputs
            raise ValueError(f"`height` and `width` have to be divisible by 8 but are {height} and {width}.")
        factor = components["vae_scale_factor"]
        with torch.no_grad():
            # 4. Prepare timesteps (before the latents: init_noise_sigma may depend on them)
            scheduler = _ddim(components["scheduler_config"], steps, device="cpu")
            # 5. prepare_latents: the request's only draw from its generator
            shape = (1, components["num_channels_latents"], height // factor, width // factor)
            generator = torch.Generator(device="cpu").manual_seed(seed)
            latents = randn_tensor(
                shape, generator=generator, device=torch.device("cpu"), dtype=components["latents_dtype"]
            )
            latents = latents * scheduler.init_noise_sigma
        return {"latents": latents, "timesteps": scheduler.timesteps}


class SdUnet(ModelFn):
    """One denoising step of the UNet with CFG: the guided ``noise_pred`` shaped like ``latents``.

    Optional inputs: ``lora`` (a safetensors path, "" = none) and ``lora_scale`` (default 1.0),
    applied with :class:`LoraSwitch` (loaded once per file, ``set_adapters`` per call, never fused:
    the pipeline's ``load_lora_weights`` + ``set_adapters([name], [scale])``); and the ControlNet's
    ``down_block_res_samples`` / ``mid_block_res_sample`` as callback inputs, fetched lazily
    inside the forward."""

    fn_name = "sd.unet"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("prompt_embeds")
        self.add_input("down_block_res_samples", callback=True, optional=True)
        self.add_input("mid_block_res_sample", callback=True, optional=True)
        self.add_input("lora", optional=True)
        self.add_input("lora_scale", optional=True)
        self.add_output("noise_pred")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import DDIMScheduler, UNet2DConditionModel

        unet = load_component(UNet2DConditionModel, model_path, "unet", device, loader)
        if unet.config.time_cond_proj_dim is not None:
            raise NotImplementedError(f"{model_path}: UNets with time_cond_proj_dim (LCM) are not mirrored")
        return with_loads(
            {
                "unet": unet,
                "lora": LoraSwitch(unet, _load_unet_lora),
                "scheduler": DDIMScheduler.from_config(_scheduler_config(model_path)),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        unet, scheduler = components["unet"], components["scheduler"]
        device = unet.device
        latents = inputs["latents"].to(device)
        prompt_embeds = inputs["prompt_embeds"].to(device)
        guidance_scale = float(inputs["guidance_scale"])
        do_cfg = _do_classifier_free_guidance(guidance_scale, unet.config)
        _check_cfg_batch(prompt_embeds, latents, do_cfg)
        lora_scale = inputs.get("lora_scale")
        components["lora"].use(inputs.get("lora") or None, 1.0 if lora_scale is None else float(lora_scale))

        down, mid = inputs.get("down_block_res_samples"), inputs.get("mid_block_res_sample")
        if (down is None) != (mid is None):
            raise ValueError(
                "bind both ControlNet outputs (down_block_res_samples, mid_block_res_sample) or neither"
            )
        # Stand-ins: the Deferred is called where the forward first consumes the residuals.
        down = lazy_list(down, lambda samples: [d.to(device) for d in samples])
        mid = lazy_addend(mid, lambda sample: sample.to(device))

        t = inputs["timesteps"].to(device)[int(inputs["step"])]
        with torch.no_grad():
            # expand the latents if we are doing classifier free guidance
            latent_model_input = torch.cat([latents] * 2) if do_cfg else latents
            latent_model_input = scheduler.scale_model_input(latent_model_input, t)
            # predict the noise residual (SD passes no residual kwargs: None is their default)
            noise_pred = unet(
                latent_model_input,
                t,
                encoder_hidden_states=prompt_embeds,
                timestep_cond=None,
                cross_attention_kwargs=None,
                down_block_additional_residuals=down,
                mid_block_additional_residual=mid,
                added_cond_kwargs=None,
                return_dict=False,
            )[0]
            # perform guidance
            if do_cfg:
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        return {"noise_pred": noise_pred}


class SdDdimStep(ModelFn):
    """One DDIM step (eta=0), stateless: ``latents`` of step ``step + 1``."""

    fn_name = "sd.ddim_step"

    def setup_io(self) -> None:
        self.add_input("noise_pred")
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("num_inference_steps")
        self.add_output("latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        return {"scheduler_config": _scheduler_config(model_path)}

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        latents = inputs["latents"]
        noise_pred = inputs["noise_pred"].to(latents.device)
        step, steps = int(inputs["step"]), int(inputs["num_inference_steps"])
        with torch.no_grad():
            scheduler = _ddim(components["scheduler_config"], steps, device=latents.device)
            timesteps = inputs["timesteps"].to(latents.device)
            if not torch.equal(scheduler.timesteps, timesteps):
                raise ValueError(f"timesteps do not match a {steps}-step DDIM schedule")
            # compute the previous noisy sample x_t -> x_t-1 (prepare_extra_step_kwargs: eta=0.0;
            # the generator it also passes is not drawn from when eta is 0)
            latents = scheduler.step(noise_pred, timesteps[step], latents, eta=0.0, return_dict=False)[0]
        return {"latents": latents}


class SdVaeDecode(ModelFn):
    """Latents to pixels: ``image``, a uint8 [H, W, 3] tensor equal to ``np.array`` of the
    pipeline's PIL image."""

    fn_name = "sd.vae_decode"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_output("image")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
        factor = vae_scale_factor(vae.config)
        return with_loads({"vae": vae, "image_processor": VaeImageProcessor(vae_scale_factor=factor)})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        with torch.no_grad():
            latents = inputs["latents"].to(vae.device)
            image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
            # run_safety_checker with safety_checker=None: has_nsfw_concept None -> denormalize all.
            denormalize = [True] * image.shape[0]
            return {"image": to_uint8_image(image_processor, image, do_denormalize=denormalize)}
