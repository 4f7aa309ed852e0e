"""The SD3 ControlNet ModelFns: the ControlNet-only stretches of ``StableDiffusion3ControlNetPipeline``.

Each class mirrors one stretch of ``StableDiffusion3ControlNetPipeline.__call__``
(``diffusers/pipelines/controlnet_sd3/pipeline_stable_diffusion_3_controlnet.py``, diffusers 0.42.1;
"CN" below). The rest of that pipeline is ``StableDiffusion3Pipeline``'s, served by the nodes of
:mod:`libs.models.sd3` (``sd3.transformer`` takes this module's block samples as a callback input), so a
ControlNet workflow of both modules' nodes reproduces the monolithic pipeline's image bitwise:

===========================  ====================================================================
ModelFn (``fn_name``)        what it mirrors
===========================  ====================================================================
``sd3.control_image``        CN step 3: ``prepare_image`` and the VAE encoding of the control
                             image
``sd3.controlnet``           the ControlNet call of one step of CN's loop (``controlnet_keep``,
                             the pooled projections it sees, ``self.controlnet(...)``)
===========================  ====================================================================

ControlNet (the paper, §5.2). ``sd3.controlnet`` runs as its own node every step, in parallel with ``sd3.transformer``,
which fetches its ``control_block_samples`` mid-forward (see :mod:`libs.models.sd3`). The ControlNet sees
``prompt_embeds`` (if it has a context embedder) and zero pooled projections when its config sets
``force_zeros_for_pooled_projection`` (InstantX ControlNets), else ``pooled_prompt_embeds``.
Classifier-free guidance batches ``[uncond, cond]`` here as in the base nodes.

Two RNG facts of the ControlNet pipeline. (1) It VAE-encodes the control image *doubled for CFG* and
samples ``latent_dist.sample()`` with **no generator**, i.e. from torch's global RNG, while the initial
noise comes from the request's ``generator``; nothing else draws from the global RNG before that sample.
``sd3.control_image`` draws the same sample from a private CPU ``torch.Generator`` seeded with the request's
``seed`` (never touching the global RNG, which other threads of an executor share): the monolithic
pipeline gives the same image when called as ``torch.manual_seed(seed); pipe(...,
generator=torch.Generator().manual_seed(seed))``, which is what the tests do. (2) The shift subtracted from
the control latents is 0 for ``force_zeros_for_pooled_projection`` ControlNets and the VAE's
``shift_factor`` otherwise (CN step 3). That flag lives in the ControlNet's config while the VAE lives
in the base model, so the workflow binds it as a constant to ``sd3.control_image`` and to
``sd3.controlnet``, which checks it against its own config and refuses a mismatch.

Dtypes follow the pipeline as loaded by ``from_pretrained`` without ``torch_dtype``: the control image is
cast to the transformer's dtype (fp32, as diffusers models load).

This module imports no torch, diffusers or transformers at import time: the registry reads
``signature()`` of these classes in a process without torch. The helpers it shares with the base nodes
(CFG test) are :mod:`libs.models.sd3`'s, the platform helpers :mod:`libs.models.common`'s.
``load_model`` puts the models on the device it is given.
"""

from __future__ import annotations

from typing import Any

from libs.models.common import load_component, vae_scale_factor, with_loads
from libs.models.sd3 import _do_cfg
from libs.workflow.modelfn import ModelFn


class SD3ControlImage(ModelFn):
    """The control image as the ControlNet pipeline feeds it: ``control_latents`` [B, C, H/f, W/f],
    VAE-encoded, sampled, shifted and scaled (B = 2 under CFG, each row its own sample).

    ``force_zeros_for_pooled_projection`` is the ControlNet's config flag (bind it as a constant):
    it decides whether the VAE's shift is subtracted."""

    fn_name = "sd3.control_image"

    def setup_io(self) -> None:
        self.add_input("control_image")
        self.add_input("height")
        self.add_input("width")
        self.add_input("seed")
        self.add_input("guidance_scale")
        self.add_input("force_zeros_for_pooled_projection")
        self.add_output("control_latents")

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
        height, width = int(inputs["height"]), int(inputs["width"])
        if height % 8 != 0 or width % 8 != 0:  # the ControlNet pipeline's check_inputs
            raise ValueError(f"`height` and `width` have to be divisible by 8 but are {height} and {width}.")
        with torch.no_grad():
            # prepare_image with batch_size 1: resize + normalise, cast to the transformer's
            # dtype (fp32: diffusers models load in fp32), doubled for CFG before the VAE sees it.
            image = image_processor.preprocess(inputs["control_image"], height=height, width=width)
            image = image.repeat_interleave(1, dim=0).to(device=vae.device, dtype=torch.float32)
            if _do_cfg(inputs["guidance_scale"]):
                image = torch.cat([image] * 2)
            # CN's vae.encode(...).latent_dist.sample() draws from the global RNG; a private generator seeded with `seed` draws the same
            # numbers as the global RNG right after torch.manual_seed(seed) (module docstring).
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            control_latents = vae.encode(image).latent_dist.sample(generator=generator)
            # CN step 3: InstantX-style ControlNets do not apply the shift factor
            shift = 0 if inputs["force_zeros_for_pooled_projection"] else vae.config.shift_factor
            control_latents = (control_latents - shift) * vae.config.scaling_factor
        return {"control_latents": control_latents}


class SD3ControlNet(ModelFn):
    """One step of an ``SD3ControlNetModel``: ``control_block_samples``, a list of [B, tokens, dim]
    residuals (already multiplied by the conditioning scale) for ``sd3.transformer``."""

    fn_name = "sd3.controlnet"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("prompt_embeds")
        self.add_input("pooled_prompt_embeds")
        self.add_input("control_latents")
        self.add_input("control_scale")
        self.add_input("control_guidance_start", optional=True)
        self.add_input("control_guidance_end", optional=True)
        self.add_input("force_zeros_for_pooled_projection", optional=True)
        self.add_output("control_block_samples")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import SD3ControlNetModel

        controlnet = load_component(SD3ControlNetModel, model_path, None, device, loader)
        if not controlnet.config.use_pos_embed:
            # The pipeline's __init__ then borrows the base transformer's pos_embed (SD3.5 8b ControlNets).
            raise NotImplementedError(f"{model_path}: ControlNets without their own pos_embed are not served")
        return with_loads({"controlnet": controlnet})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        controlnet = components["controlnet"]
        config = controlnet.config
        bound = inputs.get("force_zeros_for_pooled_projection")
        if bound is not None and bool(bound) != bool(config.force_zeros_for_pooled_projection):
            raise ValueError(
                f"the workflow binds force_zeros_for_pooled_projection={bound} but this ControlNet's config "
                f"says {config.force_zeros_for_pooled_projection}: sd3.control_image would shift the latents wrongly"
            )
        device = controlnet.device
        latents = inputs["latents"].to(device)
        timesteps = inputs["timesteps"].to(device)
        i = int(inputs["step"])
        with torch.no_grad():
            latent_model_input = torch.cat([latents] * 2) if _do_cfg(inputs["guidance_scale"]) else latents
            timestep = timesteps[i].expand(latent_model_input.shape[0])
            # CN step 6: controlnet_keep for a single ControlNet, then the loop's cond_scale
            start = float(inputs.get("control_guidance_start", 0.0))
            end = float(inputs.get("control_guidance_end", 1.0))
            n = len(timesteps)
            keep = 1.0 - float(i / n < start or (i + 1) / n > end)
            cond_scale = float(inputs["control_scale"]) * keep
            pooled_prompt_embeds = inputs["pooled_prompt_embeds"].to(device)
            if config.force_zeros_for_pooled_projection:  # CN step 6
                controlnet_pooled_projections = torch.zeros_like(pooled_prompt_embeds)
            else:
                controlnet_pooled_projections = pooled_prompt_embeds
            encoder_hidden_states = (
                inputs["prompt_embeds"].to(device) if config.joint_attention_dim is not None else None
            )
            control_block_samples = controlnet(
                hidden_states=latent_model_input,
                timestep=timestep,
                encoder_hidden_states=encoder_hidden_states,
                pooled_projections=controlnet_pooled_projections,
                joint_attention_kwargs=None,
                controlnet_cond=inputs["control_latents"].to(device),
                conditioning_scale=cond_scale,
                return_dict=False,
            )[0]
        return {"control_block_samples": list(control_block_samples)}
