"""The Flux ControlNet ModelFns: the ControlNet-only stretches of diffusers' ``FluxControlNetPipeline``.

Each class mirrors one stretch of ``diffusers/pipelines/flux/pipeline_flux_controlnet.py`` (diffusers
0.42.1) and runs it on its own. The rest of that pipeline is ``FluxPipeline``'s, served by the nodes of
:mod:`libs.models.flux` (``flux.prepare_latents`` with ``generator_state`` bound, ``flux.transformer``
with the residuals bound), so a ControlNet workflow of both modules' nodes reproduces the monolithic
pipeline's image bitwise.

==========================  =====================================================================
ModelFn (``fn_name``)       what it mirrors
==========================  =====================================================================
``flux.control_encoder``    ControlNet pipeline step 3: ``prepare_image``, ``vae.encode`` sampled
                            with the request's generator, shift/scale, ``_pack_latents``
``flux.controlnet``         the ``self.controlnet(...)`` call of the ControlNet pipeline's loop
==========================  =====================================================================

Control guidance start/end other than (0, 1), ControlNet-Union modes and XLabs-style ControlNets (with
an ``input_hint_block``) are not mirrored.

ControlNet (the paper, §5.2). ``flux.controlnet`` is its own node every step, running in parallel with
``flux.transformer``, which declares the two residual lists as optional *callback* inputs and fetches
them mid-forward (see :mod:`libs.models.flux`).

The generator trap. ``FluxControlNetPipeline`` samples the control image's VAE posterior with the
request's generator *before* it draws the initial noise from it. ``flux.control_encoder`` therefore
outputs the generator's state after its draw (``torch.Generator.get_state()``, a uint8 tensor that
round-trips exactly), and ``flux.prepare_latents`` continues from it when its optional
``generator_state`` input is bound, instead of seeding a fresh generator.

This module imports no torch, diffusers or transformers at import time: the registry reads
``signature()`` of these classes in a process without torch. The helpers it shares with the base
nodes (packing) are :mod:`libs.models.flux`'s, the platform helpers :mod:`libs.models.common`'s.
``load_model`` puts the models on the device it is given; ``flux.control_encoder`` samples with a
CPU generator (``randn_tensor`` draws on the generator's device, then moves).
"""

from __future__ import annotations

from typing import Any

from libs.models.common import load_component, vae_scale_factor, with_loads
from libs.models.flux import _pack_latents
from libs.workflow.modelfn import ModelFn


class FluxControlImageEncoder(ModelFn):
    """The control image as ControlNet input: ``controlnet_cond`` [1, seq, 4C] (VAE latents of the
    resized image, sampled, shifted, scaled and packed), and ``generator_state``, the request
    generator's state after that sample (for ``flux.prepare_latents``). Loads the base model's VAE."""

    fn_name = "flux.control_encoder"

    def setup_io(self) -> None:
        self.add_input("control_image")
        self.add_input("height")
        self.add_input("width")
        self.add_input("seed")
        self.add_output("controlnet_cond")
        self.add_output("generator_state")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
        transformer_config = FluxTransformer2DModel.load_config(model_path, subfolder="transformer")
        return with_loads(
            {
                "vae": vae,
                # FluxControlNetPipeline.__init__: the image processor works in multiples of 2x the
                # VAE's scale factor (packing).
                "image_processor": VaeImageProcessor(vae_scale_factor=vae_scale_factor(vae.config) * 2),
                "num_channels_latents": int(transformer_config["in_channels"]) // 4,
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        image = inputs["control_image"]
        if image is None:
            raise ValueError("control_image is required")
        with torch.no_grad():
            # The request's generator, seeded as the caller of the pipeline seeds it.
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            # 3. Prepare control image (FluxControlNetPipeline.__call__): prepare_image (its
            # preprocess = resize to height x width rounded down to the processor's multiple,
            # normalise to [-1, 1]) at the VAE's dtype.
            control = image_processor.preprocess(
                image, height=int(inputs["height"]), width=int(inputs["width"])
            )
            # prepare_image's repeat_interleave (by batch size 1) is not a no-op for the bits: it
            # turns preprocess's channels-last strided tensor into a contiguous one, and the VAE's
            # convolutions round differently on the two layouts.
            control = control.repeat_interleave(1, dim=0)
            control = control.to(device=vae.device, dtype=vae.dtype)
            # vae encode: retrieve_latents(..., generator) samples the posterior, the
            # generator's first draw of the request.
            control = vae.encode(control).latent_dist.sample(generator)
            control = (control - vae.config.shift_factor) * vae.config.scaling_factor
            # pack, with the transformer's channel count as the pipeline does
            channels = components["num_channels_latents"]
            if control.shape[1] != channels:
                raise ValueError(
                    f"the VAE gives {control.shape[1]} latent channels, the transformer wants {channels}"
                )
            control = _pack_latents(control, control.shape[2], control.shape[3])
        return {"controlnet_cond": control, "generator_state": generator.get_state()}


class FluxControlNet(ModelFn):
    """One ControlNet step (``FluxControlNetModel``): the residuals ``controlnet_block_samples`` and
    ``controlnet_single_block_samples``, lists of [1, seq, inner_dim] tensors already multiplied by
    the conditioning scale. Runs in parallel with ``flux.transformer`` of the same step."""

    fn_name = "flux.controlnet"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("controlnet_cond")
        self.add_input("control_scale")
        self.add_input("prompt_embeds")
        self.add_input("pooled_prompt_embeds")
        self.add_input("text_ids")
        self.add_input("latent_image_ids")
        self.add_output("controlnet_block_samples")
        self.add_output("controlnet_single_block_samples")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FluxControlNetModel

        controlnet = load_component(FluxControlNetModel, model_path, None, device, loader)
        if controlnet.input_hint_block is not None:
            # The pipeline feeds such (XLabs) ControlNets the preprocessed image, not VAE latents,
            # and the transformer repeats their blocks (controlnet_blocks_repeat=True).
            raise NotImplementedError(f"{model_path}: ControlNets with an input_hint_block are not supported")
        if controlnet.union:
            raise NotImplementedError(f"{model_path}: ControlNet-Union (control modes) is not supported")
        return with_loads({"controlnet": controlnet})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        controlnet = components["controlnet"]
        device = controlnet.device
        latents = inputs["latents"].to(device)
        timesteps = inputs["timesteps"].to(device)
        step = int(inputs["step"])
        with torch.no_grad():
            # FluxControlNetPipeline.__call__'s controlnet_keep with the default
            # control_guidance_start=0.0 and control_guidance_end=1.0: controlnet_keep[i] (1.0 at
            # every step).
            n = len(timesteps)
            keep = 1.0 - float(step / n < 0.0 or (step + 1) / n > 1.0)
            # 7. Denoising loop body, up to the controlnet call.
            t = timesteps[step]
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            use_guidance = controlnet.config.guidance_embeds
            guidance = (
                torch.tensor([float(inputs["guidance_scale"])], device=device) if use_guidance else None
            )
            guidance = guidance.expand(latents.shape[0]) if guidance is not None else None
            cond_scale = float(inputs["control_scale"]) * keep
            block_samples, single_block_samples = controlnet(
                hidden_states=latents,
                controlnet_cond=inputs["controlnet_cond"].to(device),
                controlnet_mode=None,
                conditioning_scale=cond_scale,
                timestep=timestep / 1000,
                guidance=guidance,
                pooled_projections=inputs["pooled_prompt_embeds"].to(device),
                encoder_hidden_states=inputs["prompt_embeds"].to(device),
                txt_ids=inputs["text_ids"].to(device),
                img_ids=inputs["latent_image_ids"].to(device),
                joint_attention_kwargs={},
                return_dict=False,
            )
        # The model returns None for an empty list; outputs are lists of tensors.
        return {
            "controlnet_block_samples": list(block_samples or []),
            "controlnet_single_block_samples": list(single_block_samples or []),
        }
