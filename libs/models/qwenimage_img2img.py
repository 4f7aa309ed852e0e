"""The Qwen-Image image-to-image and inpainting ModelFns: what ``QwenImageImg2ImgPipeline.__call__``
("I2I", ``diffusers/pipelines/qwenimage/pipeline_qwenimage_img2img.py``) and
``QwenImageInpaintPipeline.__call__`` ("INP", ``pipeline_qwenimage_inpaint.py``), diffusers 0.42.1,
do beyond ``QwenImagePipeline``. The rest of both workflows is :mod:`libs.models.qwenimage`'s
(``qwenimage.text_encoder``, ``qwenimage.transformer``, ``qwenimage.scheduler_step``,
``qwenimage.vae_decode``): both pipelines' ``encode_prompt`` and loop body are
``QwenImagePipeline``'s.

=============================  ==================================================================
ModelFn (``fn_name``)          what it mirrors
=============================  ==================================================================
``qwenimage.vae_encode``       I2I step 2 (``image_processor.preprocess``), step 4 (sigmas, ``mu``,
                               ``retrieve_timesteps``, ``get_timesteps``) and ``prepare_latents``:
                               the picture as a one-frame video [1, 3, 1, H, W], the posterior
                               sampled with the generator, ``_encode_vae_image``'s normalisation
                               ``(x - latents_mean) * (1 / latents_std)``, the frame axis moved
                               behind the channels, noise from the same generator, ``scale_noise``
                               at the first timestep run, packing
``qwenimage.inpaint_latents``  the same for INP, which also returns the packed ``noise`` and
                               image latents (``init_latents``), and the mask of ``mask_processor`` and
                               ``prepare_mask_latents`` (resized to the latents, nearest, repeated
                               over the channels, packed)
``qwenimage.inpaint_blend``    INP's lines after each ``scheduler.step``: the image latents
                               re-noised with ``scale_noise`` to the next timestep, then
                               ``(1 - init_mask) * init_latents_proper + init_mask * latents``
=============================  ==================================================================

``init_latents`` is INP's ``image_latents`` under another name: ``qwenimage.transformer`` binds an
``image_latents`` by name (the instruction edit's), which inpainting must not feed it.

The schedule, as Flux's (:mod:`libs.models.flux_img2img`): ``get_timesteps`` skips the first
``int(n - n * strength)`` steps, so the loop has ``fraction="strength"`` and ``rounding="start"`` and
its index stays a position in the whole schedule; ``timesteps`` is the whole schedule and
``qwenimage.scheduler_step`` pins ``set_begin_index(step)``, the pipelines'
``set_begin_index(t_start)`` advanced by the iteration. ``scale_noise`` reads
``sigmas[step_index]`` (``sigmas[begin_index]`` before the first step), which
``qwenimage.inpaint_blend`` pins with ``set_begin_index(step + 1)`` on a fresh scheduler.

Dtypes: the picture, the noise and the mask take ``prompt_embeds.dtype`` (the text encoder's).
Generator: one ``torch.Generator().manual_seed(seed)``, the posterior's sample first, then the noise
(INP's encoding of the masked picture is a third draw that feeds nothing: skipped). Mask convention:
diffusers', white (>= 0.5) repainted. Not mirrored: ``padding_mask_crop``, user-given ``latents``,
``masked_image_latents`` or image latents as ``image``, custom ``sigmas``. No torch or diffusers at
import time.
"""

from __future__ import annotations

from typing import Any

from libs.models.common import config_dtype, load_component, run_dtype, with_loads
from libs.models.qwenimage_latents import (
    _latent_size,
    _latents_stats,
    _pack_latents,
    _scheduler,
    _set_timesteps,
    _vae_scale_factor,
)
from libs.workflow.dag import tail_start
from libs.workflow.modelfn import ModelFn


def _prepared(components: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """I2I/INP steps 2-5: the schedule and the packed ``latents``, ``noise`` and ``init_latents``
    (``prepare_latents``' ``image_latents``)."""
    import torch
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import retrieve_latents
    from diffusers.utils.torch_utils import randn_tensor

    vae, dtype, channels = components["vae"], components["latents_dtype"], components["num_channels_latents"]
    steps, height, width = int(inputs["num_inference_steps"]), int(inputs["height"]), int(inputs["width"])
    lh, lw = _latent_size(height, width, components["vae_scale_factor"])
    # 2. Preprocess image
    init_image = components["image_processor"].preprocess(inputs["image"], height=height, width=width)
    init_image = init_image.to(dtype=torch.float32)
    # 4. Prepare timesteps: retrieve_timesteps with the sigmas and mu, then get_timesteps
    scheduler = _scheduler(components["scheduler_config"])
    _set_timesteps(scheduler, steps, (lh // 2) * (lw // 2), device="cpu")
    t_start = tail_start(steps, float(inputs["strength"]), "start")
    if t_start >= steps:
        raise ValueError(
            f"strength {inputs['strength']} leaves none of the {steps} steps (num_inference_steps * strength < 1)"
        )
    scheduler.set_begin_index(t_start)
    latent_timestep = scheduler.timesteps[t_start : t_start + 1]
    # 5. prepare_latents: a one-frame video; the generator's first draw samples the posterior
    generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
    image = init_image.unsqueeze(2).to(device=vae.device, dtype=dtype)
    image_latents = retrieve_latents(vae.encode(image), generator=generator)
    mean, std = _latents_stats(vae.config, image_latents)
    image_latents = (image_latents - mean) * (1.0 / std)
    image_latents = torch.cat([image_latents], dim=0).transpose(1, 2)
    noise = randn_tensor(
        (1, 1, channels, lh, lw), generator=generator, device=image_latents.device, dtype=dtype
    )
    latents = scheduler.scale_noise(image_latents, latent_timestep, noise)
    return {
        "latents": _pack_latents(latents, channels, lh, lw),
        "noise": _pack_latents(noise, channels, lh, lw),
        "init_latents": _pack_latents(image_latents, channels, lh, lw),
        "timesteps": scheduler.timesteps,
    }


class QwenImageVaeEncode(ModelFn):
    """img2img's initial latents: ``latents`` [1, seq, 4C] (packed), the encoded picture noised to
    the first timestep run, and ``timesteps``, the whole schedule."""

    fn_name = "qwenimage.vae_encode"
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
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImageTransformer2DModel,
        )
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKLQwenImage, model_path, "vae", device, loader)
        factor = _vae_scale_factor(vae.config)
        latent_channels = int(vae.config.z_dim)
        transformer_config = QwenImageTransformer2DModel.load_config(model_path, subfolder="transformer")
        scheduler_config = dict(
            FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler")
        )
        _scheduler(scheduler_config)  # refuse a stochastic one at load time
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
                "scheduler_config": scheduler_config,
                # prepare_latents(..., prompt_embeds.dtype, ...): the text encoder's dtype
                "latents_dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        with torch.no_grad():
            prepared = _prepared(components, inputs)
        return {name: prepared[name] for name in self.outputs_kept}


class QwenImageInpaintLatents(QwenImageVaeEncode):
    """Inpainting's preparation: ``qwenimage.vae_encode``'s outputs, and what every step's blend
    reads: the packed image latents ``init_latents`` and ``noise``, and ``init_mask`` [1, seq, 4C], the binarised
    mask resized to the latents (nearest), repeated over the channels and packed."""

    fn_name = "qwenimage.inpaint_latents"
    outputs_kept = ("latents", "timesteps", "init_latents", "noise")

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
            out["init_mask"] = _pack_latents(mask.repeat(1, channels, 1, 1), channels, lh, lw)
        return out


class QwenImageInpaintBlend(ModelFn):
    """After step ``step``'s Euler update: ``latents`` = ``(1 - init_mask) * init_latents_proper +
    init_mask * latents``, ``init_latents_proper`` the image latents noised to the next timestep
    (as they are at the last step). Needs configs only."""

    fn_name = "qwenimage.inpaint_blend"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("init_latents")
        self.add_input("noise")
        self.add_input("init_mask")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("num_inference_steps")
        self.add_output("latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = dict(FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler"))
        _scheduler(config)
        return {"scheduler_config": config}

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        latents = inputs["latents"]
        device = latents.device
        init_latents_proper = inputs["init_latents"].to(device)
        init_mask = inputs["init_mask"].to(device)
        timesteps, step = inputs["timesteps"].to(device), int(inputs["step"])
        with torch.no_grad():
            if step < len(timesteps) - 1:
                scheduler = _scheduler(components["scheduler_config"])
                steps = int(inputs["num_inference_steps"])
                _set_timesteps(scheduler, steps, latents.shape[1], device=device)
                if not torch.equal(scheduler.timesteps, timesteps):
                    raise ValueError(
                        f"timesteps do not match a {steps}-step schedule for {latents.shape[1]} latent tokens"
                    )
                # the pipeline's scheduler is at step_index step + 1 here; scale_noise reads its sigma
                scheduler.set_begin_index(step + 1)
                init_latents_proper = scheduler.scale_noise(
                    init_latents_proper, torch.tensor([timesteps[step + 1]]), inputs["noise"].to(device)
                )
            latents = (1 - init_mask) * init_latents_proper + init_mask * latents
        return {"latents": latents}
