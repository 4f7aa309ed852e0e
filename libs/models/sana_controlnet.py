"""The Sana ControlNet ModelFns: the ControlNet-only stretches of ``SanaControlNetPipeline.__call__``.

Each class mirrors one stretch of ``diffusers/pipelines/sana/pipeline_sana_controlnet.py`` (diffusers
0.42.1) and runs it on its own. The rest of that pipeline
is ``SanaPipeline``'s, served by the nodes of :mod:`libs.models.sana` (``sana.transformer`` takes this
module's block samples as a callback input), so a ControlNet workflow of both modules' nodes reproduces
the monolithic pipeline's image bitwise:

============================  ===================================================================
ModelFn (``fn_name``)         what it mirrors
============================  ===================================================================
``sana.control_encode``       the ControlNet pipeline's step 4: ``prepare_image`` +
                              ``vae.encode(...).latent`` times ``scaling_factor``
``sana.controlnet``           the ``self.controlnet(...)`` call of the ControlNet pipeline's loop
============================  ===================================================================

ControlNet (the paper, §5.2). ``sana.control_encode`` runs once per request (the pipeline encodes the control image
once, before the loop, in a batch of two when guiding: that batch is kept, as batching changes the
bits; the encoder is deterministic, so there is no RNG-order trap). ``sana.controlnet`` runs every
step in parallel with ``sana.transformer``, which fetches its ``controlnet_block_samples`` inside the
forward (see :mod:`libs.models.sana`). Like the pipeline's loop, it does not multiply the timestep by
``timestep_scale``.

No torch, diffusers or transformers at import time: the registry reads ``signature()`` without
them. The helpers shared with the base nodes (component loading, resolution binning, CFG test) are
:mod:`libs.models.sana`'s. ``load_model`` puts the models on the device it is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libs.models.common import load_component, with_loads
from libs.models.sana import _do_cfg, _generation_size, _load_config, _load_model, _vae_scale_factor
from libs.workflow.modelfn import ModelFn


class SanaControlEncode(ModelFn):
    """The control image as ControlNet input: ``control_latents`` [B, C, h/f, w/f], B = 2 when
    guiding (the pipeline encodes the doubled batch)."""

    fn_name = "sana.control_encode"

    def setup_io(self) -> None:
        self.add_input("control_image")
        self.add_input("height")
        self.add_input("width")
        self.add_input("use_resolution_binning")
        self.add_input("guidance_scale")
        self.add_output("control_latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers.image_processor import PixArtImageProcessor

        vae = _load_model(model_path, "vae", device, loader)
        return with_loads(
            {
                "vae": vae,
                "image_processor": PixArtImageProcessor(vae_scale_factor=_vae_scale_factor(vae.config)),
                "sample_size": int(_load_config(model_path, "transformer")["sample_size"]),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        height, width = _generation_size(
            inputs["height"],
            inputs["width"],
            bool(inputs["use_resolution_binning"]),
            components["sample_size"],
        )
        image = inputs["control_image"]
        if image is None:
            raise ValueError("sana.control_encode needs a control_image")
        with torch.no_grad():
            # prepare_image, batch_size = num_images_per_prompt = 1
            if not isinstance(image, torch.Tensor):
                image = image_processor.preprocess(image, height=height, width=width)
            image = image.repeat_interleave(1, dim=0)
            image = image.to(device=vae.device, dtype=vae.dtype)
            if _do_cfg(inputs["guidance_scale"]):
                image = torch.cat([image] * 2)
            # the ControlNet pipeline's step 4: encode, scale
            control_latents = vae.encode(image).latent
            control_latents = control_latents * vae.config.scaling_factor
        return {"control_latents": control_latents}


class SanaControlNet(ModelFn):
    """One step of the Sana ControlNet: ``controlnet_block_samples``, a list of [B, tokens, dim]
    tensors already multiplied by ``control_scale``."""

    fn_name = "sana.controlnet"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("prompt_embeds")
        self.add_input("prompt_attention_mask")
        self.add_input("control_latents")
        self.add_input("control_scale")
        self.add_output("controlnet_block_samples")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        if (Path(model_path) / "model_index.json").is_file():  # a SanaControlNetPipeline folder
            controlnet = _load_model(model_path, "controlnet", device, loader)
        else:  # a ControlNet of its own (how released Sana ControlNets ship)
            from diffusers import SanaControlNetModel

            controlnet = load_component(SanaControlNetModel, model_path, None, device, loader)
        return with_loads({"controlnet": controlnet})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        controlnet = components["controlnet"]
        device, dtype = controlnet.device, controlnet.dtype
        latents = inputs["latents"].to(device)
        with torch.no_grad():
            # the ControlNet pipeline's loop body; no timestep_scale in this pipeline
            latent_model_input = torch.cat([latents] * 2) if _do_cfg(inputs["guidance_scale"]) else latents
            t = inputs["timesteps"].to(device)[int(inputs["step"])]
            timestep = t.expand(latent_model_input.shape[0])
            samples = controlnet(
                latent_model_input.to(dtype=dtype),
                encoder_hidden_states=inputs["prompt_embeds"].to(device).to(dtype=dtype),
                encoder_attention_mask=inputs["prompt_attention_mask"].to(device),
                timestep=timestep,
                return_dict=False,
                attention_kwargs=None,  # the pipeline's only key is a LoRA scale; no LoRA here
                controlnet_cond=inputs["control_latents"].to(device),
                conditioning_scale=float(inputs["control_scale"]),
            )[0]
        return {"controlnet_block_samples": list(samples)}
