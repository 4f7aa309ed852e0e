"""The Z-Image image-to-image and inpainting ModelFns: what ``ZImageImg2ImgPipeline.__call__`` ("I2I",
``diffusers/pipelines/z_image/pipeline_z_image_img2img.py``) and ``ZImageInpaintPipeline.__call__``
("INP", ``pipeline_z_image_inpaint.py``), diffusers 0.42.1, do beyond ``ZImagePipeline``. The rest of
both workflows is :mod:`libs.models.zimage`'s (text encoder, ``zimage.transformer``,
``zimage.scheduler_step``, ``zimage.vae_decode``):

============================  ===================================================================
ModelFn (``fn_name``)         what it mirrors
============================  ===================================================================
``zimage.vae_encode``         I2I's size check, ``image_processor.preprocess``, step 5 (the
                              timesteps, then ``get_timesteps``) and ``prepare_latents`` (the VAE
                              posterior sampled with the generator, shift and scale, noise from the
                              same generator, ``scale_noise`` at the first timestep run)
``zimage.inpaint_latents``    the same for INP, which also returns ``noise`` and ``image_latents``,
                              and the mask of ``mask_processor`` and ``prepare_mask_latents``
                              (resized to the latents, nearest)
``zimage.inpaint_blend``      INP's lines after each ``scheduler.step``: the image latents re-noised
                              with ``scale_noise`` to the next timestep, then
                              ``(1 - mask) * init_latents_proper + mask * latents``
============================  ===================================================================

The schedule, as Flux's (:mod:`libs.models.flux_img2img`): the loop skips the first
``int(n - n * strength)`` steps (``rounding="start"``) and keeps their indices, so ``timesteps`` is
the whole schedule and ``zimage.scheduler_step`` pins ``set_begin_index(step)``, the pipelines'
``set_begin_index(t_start)`` advanced by the iteration; ``scale_noise`` reads ``sigmas[step_index]``,
which ``zimage.inpaint_blend`` pins with ``set_begin_index(step + 1)`` on a fresh scheduler.

The picture. Both pipelines preprocess it without a size (``preprocess(image)``: its own size rounded
down to a multiple of twice the VAE's scale factor) and draw the noise at ``height`` x ``width``, so
they work only when the two agree; these nodes resize the picture to ``height`` x ``width``, the same
call whenever it does. The noise and the latents take the prompt embeddings' dtype (the text
encoder's), not fp32 as in ``ZImagePipeline``. Generator: the posterior's sample, then the noise
(INP's encoding of the masked image is a third draw that feeds nothing: skipped). Mask convention:
diffusers', white (>= 0.5) repainted. Not mirrored: user-given ``latents`` or
``masked_image_latents``. No torch or diffusers at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libs.models.common import (
    FlowMatchInpaintBlend,
    config_dtype,
    load_component,
    run_dtype,
    vae_scale_factor,
    with_loads,
)
from libs.models.zimage import _scheduler_config, _set_timesteps
from libs.workflow.dag import tail_start
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch


def _prepared(components: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """I2I/INP up to ``prepare_latents``' return: the schedule, ``latents``, ``noise``,
    ``image_latents``."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image_img2img import retrieve_latents
    from diffusers.utils.torch_utils import randn_tensor

    vae, dtype, vae_scale = components["vae"], components["latents_dtype"], components["vae_scale"]
    steps, height, width = int(inputs["num_inference_steps"]), int(inputs["height"]), int(inputs["width"])
    init_image = components["image_processor"].preprocess(inputs["image"], height=height, width=width)
    init_image = init_image.to(dtype=torch.float32)
    if height % vae_scale != 0 or width % vae_scale != 0:
        raise ValueError(f"height and width must be divisible by {vae_scale} (got {height}x{width})")
    shape = (1, components["latent_channels"], 2 * (height // vae_scale), 2 * (width // vae_scale))
    # 5. Prepare timesteps, then get_timesteps
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
    _set_timesteps(scheduler, steps, shape, device="cpu")
    t_start = tail_start(steps, float(inputs["strength"]), "start")
    if t_start >= steps:
        raise ValueError(
            f"strength {inputs['strength']} leaves none of the {steps} steps (num_inference_steps * strength < 1)"
        )
    scheduler.set_begin_index(t_start)
    latent_timestep = scheduler.timesteps[t_start : t_start + 1]
    # prepare_latents: the generator's first draw samples the posterior, its second the noise
    generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
    image = init_image.to(device=vae.device, dtype=dtype)
    image_latents = retrieve_latents(vae.encode(image), generator=generator)
    image_latents = (image_latents - vae.config.shift_factor) * vae.config.scaling_factor
    noise = randn_tensor(shape, generator=generator, device=image_latents.device, dtype=dtype)
    latents = scheduler.scale_noise(image_latents, latent_timestep, noise)
    return {
        "latents": latents,
        "timesteps": scheduler.timesteps,
        "noise": noise,
        "image_latents": image_latents,
    }


class ZImageVaeEncode(ModelFn):
    """img2img's initial latents: ``latents`` [1, C, H/8, W/8], the encoded picture noised to the
    first timestep run, and ``timesteps``, the whole schedule."""

    fn_name = "zimage.vae_encode"
    outputs_kept: tuple[str, ...] = ("latents", "timesteps")

    def setup_io(self) -> None:
        self.add_input("image")
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_input("strength")
        for name in self.outputs_kept:
            self.add_output(name)

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL, ZImageTransformer2DModel
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
        vae_scale = vae_scale_factor(vae.config) * 2
        transformer_config = ZImageTransformer2DModel.load_config(model_path, subfolder="transformer")
        return with_loads(
            {
                "vae": vae,
                "vae_scale": vae_scale,
                # I2I/INP __init__: the processors work at twice the VAE's scale factor
                "image_processor": VaeImageProcessor(vae_scale_factor=vae_scale),
                "mask_processor": VaeImageProcessor(
                    vae_scale_factor=vae_scale,
                    do_normalize=False,
                    do_binarize=True,
                    do_convert_grayscale=True,
                ),
                "latent_channels": int(transformer_config["in_channels"]),
                "scheduler_config": _scheduler_config(model_path),
                # prepare_latents(..., prompt_embeds[0].dtype, ...): the text encoder's dtype
                "latents_dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        with torch.no_grad():
            prepared = _prepared(components, inputs)
        return {name: prepared[name] for name in self.outputs_kept}


class ZImageInpaintLatents(ZImageVaeEncode):
    """Inpainting's preparation: ``zimage.vae_encode``'s outputs and what every step's blend reads,
    ``image_latents``, ``noise`` and ``init_mask`` [1, 1, H/8, W/8], the binarised mask resized to
    the latents (nearest)."""

    fn_name = "zimage.inpaint_latents"
    outputs_kept = ("latents", "timesteps", "image_latents", "noise")

    def setup_io(self) -> None:
        self.add_input("mask")
        super().setup_io()
        self.add_output("init_mask")

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        height, width, vae_scale = int(inputs["height"]), int(inputs["width"]), components["vae_scale"]
        with torch.no_grad():
            mask = components["mask_processor"].preprocess(inputs["mask"], height=height, width=width)
            out = super().execute(components, **inputs)
            # prepare_mask_latents
            size = (2 * (height // vae_scale), 2 * (width // vae_scale))
            mask = torch.nn.functional.interpolate(mask, size=size, mode="nearest")
            out["init_mask"] = mask.to(device=out["latents"].device, dtype=components["latents_dtype"])
        return out


class ZImageInpaintBlend(FlowMatchInpaintBlend):
    """After step ``step``'s Euler update: ``latents`` = ``(1 - init_mask) * init_latents_proper +
    init_mask * latents``, ``init_latents_proper`` the image latents noised to the next timestep
    (as they are at the last step; :class:`~libs.models.common.FlowMatchInpaintBlend`), on a
    scheduler with ``ZImageInpaintPipeline``'s timesteps (unpacked latents [B, C, H, W]). Needs
    configs only."""

    fn_name = "zimage.inpaint_blend"

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        return {"scheduler_config": _scheduler_config(model_path)}

    def set_timesteps(
        self, components: dict[str, Any], scheduler: Any, num_inference_steps: int, latents: torch.Tensor
    ) -> None:
        _set_timesteps(scheduler, num_inference_steps, latents.shape, device=latents.device)

    def schedule_for(self, latents: torch.Tensor) -> str:
        return f"latents of {tuple(latents.shape)}"
