"""The Stable Diffusion 1.5 ControlNet ModelFns: the ControlNet-only stretches of diffusers'
``StableDiffusionControlNetPipeline.__call__``.

Each class mirrors one stretch of ``diffusers/pipelines/controlnet/pipeline_controlnet.py`` ("CN"
below, diffusers 0.42.1) and runs it on its own. The rest of that pipeline is
``StableDiffusionPipeline``'s, served by the nodes of :mod:`libs.models.sd` (``sd.unet`` takes this
module's residuals as callback inputs), so a ControlNet workflow of both modules' nodes reproduces the
monolithic pipeline's image bitwise:

=========================  ========================================================================
ModelFn (``fn_name``)      what it mirrors
=========================  ========================================================================
``sd.control_image``       CN step 4, ``prepare_image``'s ``control_image_processor.preprocess``
``sd.controlnet``          CN step 8: the ``self.controlnet(...)`` call of one loop iteration
=========================  ========================================================================

ControlNet (the paper, §5.2). ``sd.controlnet`` runs every step beside ``sd.unet``; both need only
the previous step's latents, and ``sd.unet`` fetches the residuals mid-forward (see
:mod:`libs.models.sd`). ``guess_mode`` is CN's ``False or controlnet.config.global_pool_conditions``;
``control_guidance_start/end`` are fixed at CN's defaults 0.0/1.0 (kept in the ``controlnet_keep``
formula); multi-ControlNets are not mirrored.

``prepare_image`` is split between the two nodes: ``sd.control_image`` preprocesses once per request,
``sd.controlnet`` does the tail (``repeat_interleave`` by the batch size 1, the cast to the
ControlNet's dtype, the CFG copy) every step. The ``repeat_interleave`` is not a no-op for the bits:
it turns preprocess's channels-last strided tensor into a contiguous one, and the ControlNet's
convolutions round differently on the two layouts.

No torch, diffusers or transformers at import time: the registry reads ``signature()`` without them.
The helpers shared with the base nodes (the CFG batch check) are :mod:`libs.models.sd`'s, the
platform helpers :mod:`libs.models.common`'s. ``load_model`` puts the ControlNet on the device it
is given.
"""

from __future__ import annotations

from typing import Any

from libs.models.common import load_component, vae_scale_factor, with_loads
from libs.models.sd import _check_cfg_batch
from libs.workflow.modelfn import ModelFn


class SdControlImage(ModelFn):
    """The control image as the ControlNet takes it: ``control_cond`` [1, 3, H, W] float32 in [0, 1].

    CN ``prepare_image`` up to its ``.to(dtype=torch.float32)``; the rest (cast to the ControlNet's
    dtype, the CFG duplication) is in ``sd.controlnet``. Its model is the *base* pipeline: the
    processor's ``vae_scale_factor`` comes from the base VAE config."""

    fn_name = "sd.control_image"

    def setup_io(self) -> None:
        self.add_input("control_image")
        self.add_input("height")
        self.add_input("width")
        self.add_output("control_cond")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL
        from diffusers.image_processor import VaeImageProcessor

        factor = vae_scale_factor(AutoencoderKL.load_config(model_path, subfolder="vae"))
        # CN __init__: self.control_image_processor
        processor = VaeImageProcessor(vae_scale_factor=factor, do_convert_rgb=True, do_normalize=False)
        return {"control_image_processor": processor}

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        height, width = int(inputs["height"]), int(inputs["width"])
        processor = components["control_image_processor"]
        image = processor.preprocess(inputs["control_image"], height=height, width=width).to(
            dtype=torch.float32
        )
        return {"control_cond": image}


class SdControlNet(ModelFn):
    """One ControlNet step: ``down_block_res_samples`` (list, one per UNet skip connection) and
    ``mid_block_res_sample``, in the UNet's CFG batch layout."""

    fn_name = "sd.controlnet"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("prompt_embeds")
        self.add_input("control_cond")
        self.add_input("control_scale")
        self.add_output("down_block_res_samples")
        self.add_output("mid_block_res_sample")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import ControlNetModel, DDIMScheduler

        controlnet = load_component(ControlNetModel, model_path, None, device, loader)
        # DDIM's scale_model_input is the identity whatever its config or state (see libs.models.sd).
        return with_loads({"controlnet": controlnet, "scheduler": DDIMScheduler()})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        controlnet, scheduler = components["controlnet"], components["scheduler"]
        device = controlnet.device
        latents = inputs["latents"].to(device)
        prompt_embeds = inputs["prompt_embeds"].to(device)
        # CFG is on iff sd.text_encoder produced [negative, positive] (guidance_scale > 1).
        do_cfg = prompt_embeds.shape[0] == 2 * latents.shape[0]
        _check_cfg_batch(prompt_embeds, latents, do_cfg)
        guess_mode = bool(
            controlnet.config.global_pool_conditions
        )  # CN: guess_mode or global_pool_conditions
        timesteps, i = inputs["timesteps"].to(device), int(inputs["step"])
        t = timesteps[i]
        with torch.no_grad():
            # prepare_image's tail: repeat_interleave by the batch size 1 (it makes the tensor
            # contiguous: see the module docstring), to the ControlNet's dtype, the CFG copy
            image = inputs["control_cond"].repeat_interleave(1, dim=0)
            image = image.to(device=device, dtype=controlnet.dtype)
            if do_cfg and not guess_mode:
                image = torch.cat([image] * 2)
            # 7.2 controlnet_keep with control_guidance_start=0.0, control_guidance_end=1.0
            n = len(timesteps)
            keep = 1.0 - float(i / n < 0.0 or (i + 1) / n > 1.0)
            # 8. loop body up to the controlnet call
            latent_model_input = torch.cat([latents] * 2) if do_cfg else latents
            latent_model_input = scheduler.scale_model_input(latent_model_input, t)
            if guess_mode and do_cfg:
                control_model_input = scheduler.scale_model_input(latents, t)
                controlnet_prompt_embeds = prompt_embeds.chunk(2)[1]
            else:
                control_model_input = latent_model_input
                controlnet_prompt_embeds = prompt_embeds
            cond_scale = float(inputs["control_scale"]) * keep
            down_block_res_samples, mid_block_res_sample = controlnet(
                control_model_input,
                t,
                encoder_hidden_states=controlnet_prompt_embeds,
                controlnet_cond=image,
                conditioning_scale=cond_scale,
                guess_mode=guess_mode,
                return_dict=False,
            )
            if guess_mode and do_cfg:
                # "add 0 to the unconditional batch to keep it unchanged"
                down_block_res_samples = [torch.cat([torch.zeros_like(d), d]) for d in down_block_res_samples]
                mid_block_res_sample = torch.cat(
                    [torch.zeros_like(mid_block_res_sample), mid_block_res_sample]
                )
        return {
            "down_block_res_samples": list(down_block_res_samples),
            "mid_block_res_sample": mid_block_res_sample,
        }
