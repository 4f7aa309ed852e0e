"""The Stable Diffusion 1.5 image-to-image and inpainting ModelFns: what
``StableDiffusionImg2ImgPipeline.__call__`` ("I2I" below,
``diffusers/pipelines/stable_diffusion/pipeline_stable_diffusion_img2img.py``) and
``StableDiffusionInpaintPipeline.__call__`` ("INP", ``pipeline_stable_diffusion_inpaint.py``),
diffusers 0.42.1, do beyond the text-to-image pipeline. The rest of both workflows is
:mod:`libs.models.sd`'s (text encoder, ``sd.unet``, ``sd.ddim_step``, ``sd.vae_decode``):

=========================  ========================================================================
ModelFn (``fn_name``)      what it mirrors
=========================  ========================================================================
``sd.vae_encode``          I2I steps 4-6: ``image_processor.preprocess``, ``retrieve_timesteps`` and
                           ``get_timesteps``, ``prepare_latents`` (VAE-encode with the generator,
                           ``scaling_factor``, noise from the same generator, ``add_noise`` at the
                           first timestep run)
``sd.inpaint_latents``     INP steps 4-7 for a 4-channel UNet: the image encoded and the noise drawn
                           by ``prepare_latents(..., return_noise=True, return_image_latents=True)``,
                           the mask by ``mask_processor`` and ``prepare_mask_latents``' resize
``sd.inpaint_blend``       INP's ``num_channels_unet == 4`` block after each ``scheduler.step``: the
                           original latents re-noised to the next timestep, then
                           ``(1 - init_mask) * init_latents_proper + init_mask * latents``
=========================  ========================================================================

The denoising loop runs only the schedule's last ``int(num_inference_steps * strength)`` steps
(``get_timesteps``): the workflow's loop has ``fraction="strength"`` with ``rounding="count"``, so its
step index stays a position in the whole ``timesteps`` that these nodes output (DDIM has no
``set_begin_index``; ``sd.unet`` and ``sd.ddim_step`` index the whole schedule).

The picture. I2I preprocesses it without a size (``preprocess(image)``: its size rounded down to a
multiple of the VAE's scale factor); ``sd.vae_encode`` resizes it to the request's ``height`` and
``width``, which is the same call whenever those are that rounded-down size (the equality the tests
check). INP preprocesses image and mask at ``height`` x ``width``, as here. The mask follows diffusers'
convention: white (>= 0.5 after ``do_binarize``) is repainted, black kept. Not mirrored:
``padding_mask_crop``, 9-channel inpainting UNets (``sd.inpaint_latents`` refuses them), and INP's
``masked_image_latents``: with a 4-channel UNet they never reach the UNet, and their encoding is the
generator's last draw, so skipping it changes no bit.

Generator. Both pipelines draw from one ``torch.Generator().manual_seed(seed)``: first the VAE's
``latent_dist.sample``, then the noise. Each node here draws both from its own generator so seeded, in
that order. No torch or diffusers at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libs.models.common import config_dtype, load_component, run_dtype, vae_scale_factor, with_loads
from libs.models.sd import _ddim, _scheduler_config
from libs.workflow.dag import tail_start
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch


def _load_encoder(model_path: str, device: str, loader: Any) -> dict[str, Any]:
    from diffusers import AutoencoderKL
    from diffusers.image_processor import VaeImageProcessor

    vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
    return {
        "vae": vae,
        "image_processor": VaeImageProcessor(vae_scale_factor=vae_scale_factor(vae.config)),
        "scheduler_config": _scheduler_config(model_path),
        # prepare_latents casts the image (and draws the noise) in prompt_embeds.dtype
        "latents_dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
    }


def _schedule(components: dict[str, Any], inputs: dict[str, Any]) -> tuple[Any, int]:
    """``retrieve_timesteps`` then ``get_timesteps``: the DDIM scheduler and ``t_start``."""
    steps = int(inputs["num_inference_steps"])
    scheduler = _ddim(components["scheduler_config"], steps, device="cpu")
    t_start = tail_start(steps, float(inputs["strength"]), "count")
    if t_start >= steps:
        raise ValueError(
            f"strength {inputs['strength']} leaves none of the {steps} steps (num_inference_steps * strength < 1)"
        )
    return scheduler, t_start


def _encode(components: dict[str, Any], image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``_encode_vae_image`` / I2I ``prepare_latents``: the posterior sampled with ``generator``,
    times ``scaling_factor``."""
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents

    vae = components["vae"]
    image = image.to(device=vae.device, dtype=components["latents_dtype"])
    return vae.config.scaling_factor * retrieve_latents(vae.encode(image), generator=generator)


def _check_size(height: int, width: int) -> None:
    if height % 8 != 0 or width % 8 != 0:  # check_inputs
        raise ValueError(f"`height` and `width` have to be divisible by 8 but are {height} and {width}.")


class SdVaeEncode(ModelFn):
    """img2img's initial latents: ``latents`` [1, C, H/f, W/f], the encoded picture noised to the
    first timestep run, and ``timesteps``, the whole DDIM schedule (int64)."""

    fn_name = "sd.vae_encode"

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
        _check_size(height, width)
        with torch.no_grad():
            # 4. Preprocess image
            image = components["image_processor"].preprocess(inputs["image"], height=height, width=width)
            # 5. set timesteps
            scheduler, t_start = _schedule(components, inputs)
            latent_timestep = scheduler.timesteps[t_start : t_start + 1]
            # 6. prepare_latents: the generator's first draw samples the posterior, its second the noise
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            init_latents = torch.cat([_encode(components, image, generator)], dim=0)  # as prepare_latents
            noise = randn_tensor(
                init_latents.shape,
                generator=generator,
                device=init_latents.device,
                dtype=components["latents_dtype"],
            )
            latents = scheduler.add_noise(init_latents, noise, latent_timestep.to(init_latents.device))
        return {"latents": latents, "timesteps": scheduler.timesteps}


class SdInpaintLatents(ModelFn):
    """Inpainting's preparation for a 4-channel UNet: ``latents`` (pure noise at strength 1, else the
    encoded picture noised to the first timestep run), ``timesteps`` (the whole schedule), and what
    every step's blend reads: ``image_latents``, ``noise`` and ``init_mask`` [1, 1, H/f, W/f]."""

    fn_name = "sd.inpaint_latents"

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
        from diffusers import UNet2DConditionModel
        from diffusers.image_processor import VaeImageProcessor

        components = _load_encoder(model_path, device, loader)
        in_channels = int(UNet2DConditionModel.load_config(model_path, subfolder="unet")["in_channels"])
        if in_channels != 4:
            raise NotImplementedError(
                f"{model_path}: a {in_channels}-channel UNet; only the mask-per-step path of 4-channel "
                "UNets is mirrored"
            )
        factor = vae_scale_factor(components["vae"].config)
        # INP __init__: self.mask_processor
        components["mask_processor"] = VaeImageProcessor(
            vae_scale_factor=factor, do_normalize=False, do_binarize=True, do_convert_grayscale=True
        )
        components["vae_scale_factor"] = factor
        return with_loads(components)

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        height, width = int(inputs["height"]), int(inputs["width"])
        _check_size(height, width)
        strength, factor, dtype = (
            float(inputs["strength"]),
            components["vae_scale_factor"],
            components["latents_dtype"],
        )
        with torch.no_grad():
            # 4. set timesteps; "if strength is 1. then initialise the latents to noise"
            scheduler, t_start = _schedule(components, inputs)
            latent_timestep = scheduler.timesteps[t_start : t_start + 1]
            is_strength_max = strength == 1.0
            # 5. Preprocess mask and image (no padding_mask_crop: resize_mode "default")
            init_image = components["image_processor"].preprocess(inputs["image"], height=height, width=width)
            init_image = init_image.to(dtype=torch.float32)
            # 6. prepare_latents: image latents first (a 4-channel UNet returns them), then the noise
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            image_latents = _encode(components, init_image, generator)
            # prepare_latents' repeat to the batch copies the VAE's (channels-last) sample into a
            # contiguous tensor; the UNet's convolutions give other bits for the other layout
            image_latents = image_latents.repeat(1, 1, 1, 1)
            shape = (1, components["vae"].config.latent_channels, height // factor, width // factor)
            noise = randn_tensor(shape, generator=generator, device=image_latents.device, dtype=dtype)
            if is_strength_max:
                latents = noise * scheduler.init_noise_sigma
            else:
                latents = scheduler.add_noise(image_latents, noise, latent_timestep.to(noise.device))
            # 7. prepare_mask_latents: the binarised mask resized to the latents (nearest)
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


class SdInpaintBlend(ModelFn):
    """After step ``step``'s DDIM update: the kept region put back, ``latents`` =
    ``(1 - init_mask) * init_latents_proper + init_mask * latents``, where ``init_latents_proper`` is
    ``image_latents`` noised to the next timestep (as is at the last step). Needs configs only."""

    fn_name = "sd.inpaint_blend"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("image_latents")
        self.add_input("noise")
        self.add_input("init_mask")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_output("latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import DDIMScheduler

        return {"scheduler": DDIMScheduler.from_config(_scheduler_config(model_path))}

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        latents = inputs["latents"]
        device = latents.device
        init_latents_proper = inputs["image_latents"].to(device)
        init_mask = inputs["init_mask"].to(device)
        timesteps, step = inputs["timesteps"], int(inputs["step"])
        with torch.no_grad():
            if step < len(timesteps) - 1:
                noise_timestep = timesteps[step + 1]
                init_latents_proper = components["scheduler"].add_noise(
                    init_latents_proper, inputs["noise"].to(device), torch.tensor([noise_timestep])
                )
            latents = (1 - init_mask) * init_latents_proper + init_mask * latents
        return {"latents": latents}
