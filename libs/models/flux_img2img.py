"""The Flux image-to-image and inpainting ModelFns: what ``FluxImg2ImgPipeline.__call__`` ("I2I",
``diffusers/pipelines/flux/pipeline_flux_img2img.py``) and ``FluxInpaintPipeline.__call__`` ("INP",
``pipeline_flux_inpaint.py``), diffusers 0.42.1, do beyond ``FluxPipeline``. The rest of both
workflows is :mod:`libs.models.flux`'s (text encoders, ``flux.transformer``, ``flux.flow_match_step``,
``flux.vae_decode``):

==========================  =====================================================================
ModelFn (``fn_name``)       what it mirrors
==========================  =====================================================================
``flux.vae_encode``         I2I steps 2, 4 and 5: ``image_processor.preprocess``, the timesteps
                            (``calculate_shift``, ``retrieve_timesteps``, ``get_timesteps``) and
                            ``prepare_latents`` (``_encode_vae_image`` with the generator, shift and
                            scale, noise from the same generator, ``scale_noise`` at the first
                            timestep run, packing, ``latent_image_ids``)
``flux.inpaint_latents``    the same for INP, which also returns the packed ``noise`` and
                            ``image_latents``, and the mask of ``mask_processor`` and
                            ``prepare_mask_latents`` (resized to the latents, packed)
``flux.inpaint_blend``      INP's lines after each ``scheduler.step``: the image latents re-noised
                            with ``scale_noise`` to the next timestep, then
                            ``(1 - init_mask) * init_latents_proper + init_mask * latents``
==========================  =====================================================================

The schedule. Both pipelines run the last ``n - int(n - n * strength)`` steps (``get_timesteps``
rounds the steps *skipped* down, unlike SD1.5): the workflow's loop has ``fraction="strength"`` and
``rounding="start"``, so its index stays a position in the whole schedule. ``get_timesteps`` calls
``set_begin_index(t_start)``, so the pipeline's stateful scheduler is at index ``t_start + i`` at
iteration ``i``: exactly what ``flux.flow_match_step``'s ``set_begin_index(step)`` gives. Its
``scale_noise`` ignores the timestep it is passed and reads ``sigmas[step_index]`` (or
``sigmas[begin_index]`` before the first step); ``flux.inpaint_blend`` pins ``begin_index`` at
``step + 1`` on a fresh scheduler for the same sigma.

Generator. One ``torch.Generator().manual_seed(seed)``: the VAE posterior's sample first, then the
noise (INP's encoding of the masked image, a third draw, feeds nothing in ``FluxInpaintPipeline``, so
it is skipped). Mask convention: diffusers', white (>= 0.5) repainted. Not mirrored: ``padding_mask_crop``,
user-given ``latents``, true CFG (``negative_prompt``/``true_cfg_scale``), IP-Adapter. No torch or
diffusers at import time.
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
from libs.models.flux import _latent_image_ids, _latent_size, _pack_latents, _set_flux_timesteps
from libs.workflow.dag import tail_start
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch


def _prepared(components: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """I2I/INP steps 2-5 up to packing: the schedule, ``latents``, ``noise`` and ``image_latents``
    (packed), ``latent_image_ids``."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
    from diffusers.utils.torch_utils import randn_tensor

    vae, dtype = components["vae"], components["latents_dtype"]
    steps, height, width = int(inputs["num_inference_steps"]), int(inputs["height"]), int(inputs["width"])
    lh, lw = _latent_size(height, width, components["vae_scale_factor"])
    # 2. Preprocess image
    init_image = components["image_processor"].preprocess(inputs["image"], height=height, width=width)
    init_image = init_image.to(dtype=torch.float32)
    # 4. Prepare timesteps: retrieve_timesteps, then get_timesteps
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
    _set_flux_timesteps(scheduler, steps, (lh // 2) * (lw // 2), device="cpu")
    t_start = tail_start(steps, float(inputs["strength"]), "start")
    if t_start >= steps:
        raise ValueError(
            f"strength {inputs['strength']} leaves none of the {steps} steps (num_inference_steps * strength < 1)"
        )
    scheduler.set_begin_index(t_start)
    latent_timestep = scheduler.timesteps[t_start : t_start + 1]
    # 5. prepare_latents: the generator's first draw samples the posterior, its second the noise
    generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
    image = init_image.to(device=vae.device, dtype=dtype)
    image_latents = retrieve_latents(vae.encode(image), generator=generator)
    image_latents = (image_latents - vae.config.shift_factor) * vae.config.scaling_factor
    image_latents = torch.cat([image_latents], dim=0)
    shape = (1, components["num_channels_latents"], lh, lw)
    noise = randn_tensor(shape, generator=generator, device=image_latents.device, dtype=dtype)
    latents = scheduler.scale_noise(image_latents, latent_timestep, noise)
    return {
        "latents": _pack_latents(latents, lh, lw),
        "noise": _pack_latents(noise, lh, lw),
        "image_latents": _pack_latents(image_latents, lh, lw),
        "latent_image_ids": _latent_image_ids(lh // 2, lw // 2, dtype),
        "timesteps": scheduler.timesteps,
    }


class FluxVaeEncode(ModelFn):
    """img2img's initial latents: ``latents`` [1, seq, 4C] (packed), the encoded picture noised to
    the first timestep run; ``latent_image_ids`` [seq, 3] and ``timesteps``, the whole schedule."""

    fn_name = "flux.vae_encode"
    outputs_kept: tuple[str, ...] = ("latents", "latent_image_ids", "timesteps")

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
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
        factor = vae_scale_factor(vae.config)
        transformer_config = FluxTransformer2DModel.load_config(model_path, subfolder="transformer")
        latent_channels = vae.config.latent_channels
        return with_loads(
            {
                "vae": vae,
                "vae_scale_factor": factor,
                # I2I/INP __init__: packing doubles the effective scale factor
                "image_processor": VaeImageProcessor(
                    vae_scale_factor=factor * 2, vae_latent_channels=latent_channels
                ),
                "mask_processor": VaeImageProcessor(
                    vae_scale_factor=factor * 2,
                    vae_latent_channels=latent_channels,
                    do_normalize=False,
                    do_binarize=True,
                    do_convert_grayscale=True,
                ),
                "num_channels_latents": int(transformer_config["in_channels"]) // 4,
                "scheduler_config": FlowMatchEulerDiscreteScheduler.load_config(
                    model_path, subfolder="scheduler"
                ),
                # prepare_latents casts the image and draws the noise in prompt_embeds.dtype (T5's)
                "latents_dtype": config_dtype(model_path, "text_encoder_2", run_dtype(loader)),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        with torch.no_grad():
            prepared = _prepared(components, inputs)
        return {name: prepared[name] for name in self.outputs_kept}


class FluxInpaintLatents(FluxVaeEncode):
    """Inpainting's preparation: ``flux.vae_encode``'s outputs, and what every step's blend reads:
    the packed ``image_latents`` and ``noise``, and ``init_mask`` [1, seq, 4C], the binarised mask
    resized to the latents (nearest) and packed."""

    fn_name = "flux.inpaint_latents"
    outputs_kept = ("latents", "latent_image_ids", "timesteps", "image_latents", "noise")

    def setup_io(self) -> None:
        self.add_input("mask")
        super().setup_io()
        self.add_output("init_mask")

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        height, width = int(inputs["height"]), int(inputs["width"])
        lh, lw = _latent_size(height, width, components["vae_scale_factor"])
        with torch.no_grad():
            out = super().execute(components, **inputs)
            # prepare_mask_latents: resized before the cast, then repeated over the channels and packed
            mask = components["mask_processor"].preprocess(inputs["mask"], height=height, width=width)
            mask = torch.nn.functional.interpolate(mask, size=(lh, lw))
            mask = mask.to(device=out["latents"].device, dtype=components["latents_dtype"])
            channels = components["num_channels_latents"]
            out["init_mask"] = _pack_latents(mask.repeat(1, channels, 1, 1), lh, lw)
        return out


class FluxInpaintBlend(FlowMatchInpaintBlend):
    """After step ``step``'s Euler update: ``latents`` = ``(1 - init_mask) * init_latents_proper +
    init_mask * latents``, ``init_latents_proper`` the image latents noised to the next timestep
    (as they are at the last step; :class:`~libs.models.common.FlowMatchInpaintBlend`), on a
    scheduler with ``FluxInpaintPipeline``'s timesteps. Needs configs only."""

    fn_name = "flux.inpaint_blend"

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return {
            "scheduler_config": FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler")
        }

    def set_timesteps(
        self, components: dict[str, Any], scheduler: Any, num_inference_steps: int, latents: torch.Tensor
    ) -> None:
        _set_flux_timesteps(scheduler, num_inference_steps, latents.shape[1], device=latents.device)
