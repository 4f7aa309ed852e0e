"""The Stable Diffusion 3 image-to-image and inpainting ModelFns: what
``StableDiffusion3Img2ImgPipeline.__call__`` ("I2I",
``diffusers/pipelines/stable_diffusion_3/pipeline_stable_diffusion_3_img2img.py``) and
``StableDiffusion3InpaintPipeline.__call__`` ("INP", ``pipeline_stable_diffusion_3_inpaint.py``),
diffusers 0.42.1, do beyond ``StableDiffusion3Pipeline``. The rest of both workflows is
:mod:`libs.models.sd3`'s (text encoders, ``sd3.transformer``, ``sd3.flow_match_step``,
``sd3.vae_decode``):

==========================  =====================================================================
ModelFn (``fn_name``)       what it mirrors
==========================  =====================================================================
``sd3.vae_encode``          I2I steps 3-5: ``image_processor.preprocess``, the timesteps
                            (``retrieve_timesteps``, ``get_timesteps``) and ``prepare_latents``
                            (the VAE posterior sampled with the generator, shift and scale, noise
                            from the same generator, ``scale_noise`` at the first timestep run)
``sd3.inpaint_latents``     INP's for a 16-channel transformer: ``prepare_latents(...,
                            return_noise=True, return_image_latents=True)`` (pure noise at strength
                            1) and the mask of ``mask_processor`` and ``prepare_mask_latents``
``sd3.inpaint_blend``       INP's ``num_channels_transformer == 16`` block after each
                            ``scheduler.step``: the image latents re-noised with ``scale_noise`` to
                            the next timestep, then ``(1 - init_mask) * init_latents_proper +
                            init_mask * latents``
``sd3.inpaint_vae_decode``  INP's tail, ``vae.decode(latents / scaling_factor)``: unlike the other
                            SD3 pipelines (and ``sd3.vae_decode``) it does not add ``shift_factor``
                            back, which changes the image, so the inpainting workflow decodes so too
==========================  =====================================================================

The schedule, as Flux's (:mod:`libs.models.flux_img2img`): the loop skips the first
``int(n - n * strength)`` steps (``rounding="start"``) and keeps their indices; the pipelines'
``set_begin_index(t_start)`` puts their scheduler at ``t_start + i``, which ``sd3.flow_match_step``
reproduces, and ``scale_noise`` reads ``sigmas[step_index]``, which ``sd3.inpaint_blend`` pins with
``set_begin_index(step + 1)`` on a fresh scheduler.

Generator: the posterior's sample, then the noise (INP's encoding of the masked image is a third
draw that feeds nothing with a 16-channel transformer: skipped). Mask convention: diffusers', white
(>= 0.5) repainted. Not mirrored: ``padding_mask_crop``, 33-channel inpainting transformers
(refused at load), user-given ``latents``, skip-layer guidance, IP-Adapter. No torch or diffusers at
import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libs.models.common import (
    FlowMatchInpaintBlend,
    config_dtype,
    load_component,
    run_dtype,
    to_uint8_image,
    vae_scale_factor,
    with_loads,
)
from libs.models.sd3 import SD3VaeDecode, _has_component, _set_sd3_timesteps
from libs.workflow.dag import tail_start
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch


def _load_encoder(model_path: str, device: str, loader: Any) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from diffusers.image_processor import VaeImageProcessor

    vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
    factor = vae_scale_factor(vae.config)
    transformer_config = SD3Transformer2DModel.load_config(model_path, subfolder="transformer")
    clip_dtype = config_dtype(model_path, "text_encoder", run_dtype(loader))
    t5_dtype = (
        config_dtype(model_path, "text_encoder_3", run_dtype(loader))
        if _has_component(model_path, "text_encoder_3")
        else clip_dtype
    )
    latent_channels = vae.config.latent_channels
    return {
        "vae": vae,
        "vae_scale_factor": factor,
        "patch_size": int(transformer_config["patch_size"]),
        "transformer_in_channels": int(transformer_config["in_channels"]),
        # I2I/INP __init__
        "image_processor": VaeImageProcessor(vae_scale_factor=factor, vae_latent_channels=latent_channels),
        "mask_processor": VaeImageProcessor(
            vae_scale_factor=factor,
            vae_latent_channels=latent_channels,
            do_normalize=False,
            do_binarize=True,
            do_convert_grayscale=True,
        ),
        "scheduler_config": FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler"),
        # prepare_latents casts the image and draws the noise in prompt_embeds.dtype
        "latents_dtype": torch.promote_types(clip_dtype, t5_dtype),
    }


def _schedule(components: dict[str, Any], inputs: dict[str, Any]) -> tuple[Any, Any]:
    """``check_inputs``' size rule, ``retrieve_timesteps`` then ``get_timesteps``: the scheduler
    (its ``begin_index`` at ``t_start``) and ``latent_timestep``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    steps, height, width = int(inputs["num_inference_steps"]), int(inputs["height"]), int(inputs["width"])
    factor = components["vae_scale_factor"]
    multiple = factor * components["patch_size"]
    if height % multiple or width % multiple:
        raise ValueError(
            f"`height` and `width` have to be divisible by {multiple} but are {height} and {width}."
        )
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
    latent_shape = (height // factor, width // factor)
    _set_sd3_timesteps(scheduler, steps, latent_shape, components["patch_size"], device="cpu")
    t_start = tail_start(steps, float(inputs["strength"]), "start")
    if t_start >= steps:
        raise ValueError(
            f"strength {inputs['strength']} leaves none of the {steps} steps (num_inference_steps * strength < 1)"
        )
    scheduler.set_begin_index(t_start)
    return scheduler, scheduler.timesteps[t_start : t_start + 1]


def _encode(components: dict[str, Any], image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``_encode_vae_image`` / I2I ``prepare_latents``: the posterior sampled with ``generator``,
    shifted and scaled."""
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img import retrieve_latents

    vae = components["vae"]
    image = image.to(device=vae.device, dtype=components["latents_dtype"])
    latents = retrieve_latents(vae.encode(image), generator=generator)
    return (latents - vae.config.shift_factor) * vae.config.scaling_factor


class SD3VaeEncode(ModelFn):
    """img2img's initial latents: ``latents`` [1, C, H/f, W/f], the encoded picture noised to the
    first timestep run, and ``timesteps``, the whole schedule."""

    fn_name = "sd3.vae_encode"

    def setup_io(self) -> None:
        self.add_input("image")
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_input("strength")
        self.add_output("latents")
        self.add_output("timesteps")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        return with_loads(_load_encoder(model_path, device, loader))

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        height, width = int(inputs["height"]), int(inputs["width"])
        dtype = components["latents_dtype"]
        with torch.no_grad():
            # 4. Prepare timesteps (checking the size first, as check_inputs does)
            scheduler, latent_timestep = _schedule(components, inputs)
            # 3. Preprocess image
            image = components["image_processor"].preprocess(inputs["image"], height=height, width=width)
            # 5. prepare_latents: the generator's first draw samples the posterior, its second the noise
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            init_latents = torch.cat([_encode(components, image, generator)], dim=0)
            noise = randn_tensor(
                init_latents.shape, generator=generator, device=init_latents.device, dtype=dtype
            )
            latents = scheduler.scale_noise(init_latents, latent_timestep, noise)
            latents = latents.to(device=init_latents.device, dtype=dtype)
        return {"latents": latents, "timesteps": scheduler.timesteps}


class SD3InpaintLatents(ModelFn):
    """Inpainting's preparation for a 16-channel transformer: ``latents`` (the noise at strength 1,
    else the encoded picture noised to the first timestep run), ``timesteps`` (the whole schedule),
    and what every step's blend reads: ``image_latents``, ``noise`` and ``init_mask`` [1, 1, H/f, W/f]."""

    fn_name = "sd3.inpaint_latents"

    def setup_io(self) -> None:
        self.add_input("image")
        self.add_input("mask")
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_input("strength")
        self.add_output("latents")
        self.add_output("timesteps")
        self.add_output("image_latents")
        self.add_output("noise")
        self.add_output("init_mask")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        components = _load_encoder(model_path, device, loader)
        if components["transformer_in_channels"] != 16:
            raise NotImplementedError(
                f"{model_path}: a {components['transformer_in_channels']}-channel transformer; only the "
                "mask-per-step path of 16-channel transformers is mirrored"
            )
        return with_loads(components)

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        height, width = int(inputs["height"]), int(inputs["width"])
        factor, dtype = components["vae_scale_factor"], components["latents_dtype"]
        with torch.no_grad():
            scheduler, latent_timestep = _schedule(components, inputs)
            is_strength_max = float(inputs["strength"]) == 1.0
            # no padding_mask_crop: resize_mode "default"
            init_image = components["image_processor"].preprocess(inputs["image"], height=height, width=width)
            init_image = init_image.to(dtype=torch.float32)
            # prepare_latents: image latents first (a 16-channel transformer returns them), then the noise
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            image_latents = _encode(components, init_image, generator)
            # the repeat to the batch copies the VAE's sample into a contiguous tensor
            image_latents = image_latents.repeat(1, 1, 1, 1)
            shape = (1, components["vae"].config.latent_channels, height // factor, width // factor)
            noise = randn_tensor(shape, generator=generator, device=image_latents.device, dtype=dtype)
            if is_strength_max:
                latents = noise
            else:
                latents = scheduler.scale_noise(image_latents, latent_timestep, noise)
            # prepare_mask_latents: the binarised mask resized to the latents (nearest)
            mask = components["mask_processor"].preprocess(inputs["mask"], height=height, width=width)
            mask = torch.nn.functional.interpolate(mask, size=(height // factor, width // factor))
            init_mask = mask.to(device=noise.device, dtype=dtype)
        return {
            "latents": latents,
            "timesteps": scheduler.timesteps,
            "image_latents": image_latents,
            "noise": noise,
            "init_mask": init_mask,
        }


class SD3InpaintBlend(FlowMatchInpaintBlend):
    """After step ``step``'s Euler update: ``latents`` = ``(1 - init_mask) * init_latents_proper +
    init_mask * latents``, ``init_latents_proper`` the image latents noised to the next timestep
    (as they are at the last step; :class:`~libs.models.common.FlowMatchInpaintBlend`), on a
    scheduler with ``StableDiffusion3InpaintPipeline``'s timesteps (unpacked latents [B, C, H, W]).
    Needs configs only."""

    fn_name = "sd3.inpaint_blend"

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        transformer_config = SD3Transformer2DModel.load_config(model_path, subfolder="transformer")
        return {
            "scheduler_config": FlowMatchEulerDiscreteScheduler.load_config(
                model_path, subfolder="scheduler"
            ),
            "patch_size": int(transformer_config["patch_size"]),
        }

    def set_timesteps(
        self, components: dict[str, Any], scheduler: Any, num_inference_steps: int, latents: torch.Tensor
    ) -> None:
        _set_sd3_timesteps(
            scheduler, num_inference_steps, latents.shape, components["patch_size"], device=latents.device
        )

    def schedule_for(self, latents: torch.Tensor) -> str:
        return f"latents of {tuple(latents.shape)}"


class SD3InpaintVaeDecode(SD3VaeDecode):
    """Latents to pixels as INP decodes them: ``image``, a uint8 [H, W, 3] tensor equal to
    ``np.array`` of the pipeline's PIL image, from ``vae.decode(latents / scaling_factor)`` (no
    ``shift_factor``)."""

    fn_name = "sd3.inpaint_vae_decode"

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        with torch.no_grad():
            latents = inputs["latents"].to(vae.device) / vae.config.scaling_factor
            image = vae.decode(latents, return_dict=False)[0]
            return {"image": to_uint8_image(image_processor, image)}
