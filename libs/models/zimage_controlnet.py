"""The Z-Image ControlNet ModelFns: the ControlNet-only stretches of ``ZImageControlNetPipeline.__call__``.

Each class mirrors one stretch of ``diffusers/pipelines/z_image/pipeline_z_image_controlnet.py``
(diffusers 0.42.1) and runs it on its own. The rest of that pipeline is ``ZImagePipeline``'s, served
by the nodes of :mod:`libs.models.zimage` (``zimage.transformer`` takes this module's block samples
as callback inputs), so a ControlNet workflow of both modules' nodes reproduces the monolithic
pipeline's image bitwise:

============================  ===================================================================
ModelFn (``fn_name``)         what it mirrors
============================  ===================================================================
``zimage.control_encode``     the control-image block before the loop: ``prepare_image``,
                              ``vae.encode`` (``argmax``: the latent mode, no generator draw),
                              shift and scale, ``unsqueeze(2)``, the zero padding up to the
                              ControlNet's ``control_in_dim`` (the Union 2.0 layout)
``zimage.controlnet``         the ``self.controlnet(...)`` call of the loop body (with the same
                              guidance decision as the transformer's)
============================  ===================================================================

The ControlNet is not a model of its own: ``ZImageControlNetModel.from_transformer`` hands it the
transformer's time and caption embedders, patch embedder, RoPE, noise and context refiners and pad
tokens. So ``zimage.controlnet`` loads the transformer as well as the ControlNet (both from a
``ZImageControlNetPipeline`` folder) and shares them the same way; and since a LoRA loaded into the
transformer also patches those shared refiners, the node takes ``lora`` / ``lora_scale`` too and
switches the adapter on its own transformer (:class:`~libs.models.lora.LoraSwitch`), as the
pipeline's ControlNet runs with the pipeline's LoRA.

Its outputs (the paper, §5.2): ``controlnet_block_samples``, a list of [B, tokens, dim] tensors
already multiplied by ``control_scale``, and ``controlnet_layer_places`` (int64 [k]), the main
transformer layers they follow (``control_layers_places``). ``zimage.transformer`` declares both as
callback inputs and hands the transformer a lazy mapping
(:class:`~libs.models.zimage.LazyBlockSamples`) that the forward first reads after main layer 0, so
the fetch overlaps with the embedders, the refiners and one layer.

No torch, diffusers or transformers at import time: the registry reads ``signature()`` without
them. ``load_model`` puts the models on the device it is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libs.models.common import load_component, vae_scale_factor, with_loads
from libs.models.lora import LoraSwitch
from libs.models.zimage import _load_zimage_lora, guided_inputs
from libs.workflow.modelfn import ModelFn


def _require_controlnet_pipeline(model_path: str, fn_name: str) -> None:
    if not (Path(model_path) / "controlnet" / "config.json").is_file():
        raise ValueError(
            f"{fn_name} needs a ZImageControlNetPipeline folder (with controlnet/ and transformer/), "
            f"not {model_path}"
        )


class ZImageControlEncode(ModelFn):
    """The control image as ControlNet input: ``control_latents`` [1, control_in_dim, 1, h, w]
    (the VAE's dtype), encoded once per request."""

    fn_name = "zimage.control_encode"

    def setup_io(self) -> None:
        self.add_input("control_image")
        self.add_input("height")
        self.add_input("width")
        self.add_output("control_latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL, ZImageControlNetModel, ZImageTransformer2DModel
        from diffusers.image_processor import VaeImageProcessor

        _require_controlnet_pipeline(model_path, self.fn_name)
        vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
        controlnet_config = ZImageControlNetModel.load_config(model_path, subfolder="controlnet")
        transformer_config = ZImageTransformer2DModel.load_config(model_path, subfolder="transformer")
        return with_loads(
            {
                "vae": vae,
                # the pipeline's image_processor (ZImagePipeline.__init__)
                "image_processor": VaeImageProcessor(vae_scale_factor=vae_scale_factor(vae.config) * 2),
                "control_in_dim": int(controlnet_config["control_in_dim"]),
                "num_channels_latents": int(transformer_config["in_channels"]),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        image = inputs["control_image"]
        if image is None:
            raise ValueError("zimage.control_encode needs a control_image")
        height, width = int(inputs["height"]), int(inputs["width"])
        with torch.no_grad():
            # prepare_image, batch_size = num_images_per_prompt = 1, no CFG doubling
            if not isinstance(image, torch.Tensor):
                image = image_processor.preprocess(image, height=height, width=width)
            image = image.repeat_interleave(1, dim=0)
            image = image.to(device=vae.device, dtype=vae.dtype)
            # retrieve_latents(..., sample_mode="argmax")
            control = vae.encode(image).latent_dist.mode()
            control = (control - vae.config.shift_factor) * vae.config.scaling_factor
            control = control.unsqueeze(2)
            channels, control_in_dim = components["num_channels_latents"], components["control_in_dim"]
            if channels != control_in_dim:  # "For model version 2.0"
                padding = torch.zeros(control.shape[0], control_in_dim - channels, *control.shape[2:])
                control = torch.cat([control, padding.to(device=control.device, dtype=control.dtype)], dim=1)
        return {"control_latents": control}


class ZImageControlNet(ModelFn):
    """One step of the Z-Image ControlNet: ``controlnet_block_samples`` (a list of [B, tokens, dim],
    times ``control_scale``) and ``controlnet_layer_places`` (int64 [k]); see the module docstring."""

    fn_name = "zimage.controlnet"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("cfg_truncation")
        self.add_input("prompt_embeds")
        self.add_input("negative_prompt_embeds")
        self.add_input("control_latents")
        self.add_input("control_scale")
        self.add_input("lora", optional=True)
        self.add_input("lora_scale", optional=True)
        self.add_output("controlnet_block_samples")
        self.add_output("controlnet_layer_places")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import ZImageControlNetModel, ZImageTransformer2DModel

        _require_controlnet_pipeline(model_path, self.fn_name)
        transformer = load_component(ZImageTransformer2DModel, model_path, "transformer", device, loader)
        controlnet = load_component(ZImageControlNetModel, model_path, "controlnet", device, loader)
        # ZImageControlNetPipeline.__init__
        controlnet = ZImageControlNetModel.from_transformer(controlnet, transformer)
        return with_loads(
            {
                "controlnet": controlnet,
                "transformer": transformer,
                "lora": LoraSwitch(transformer, _load_zimage_lora),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        controlnet, transformer = components["controlnet"], components["transformer"]
        device, dtype = transformer.device, transformer.dtype
        lora_scale = inputs.get("lora_scale")
        components["lora"].use(inputs.get("lora") or None, 1.0 if lora_scale is None else float(lora_scale))
        with torch.no_grad():
            # the loop body up to the ControlNet call
            _, apply_cfg, latent_list, timestep_model_input, embeds = guided_inputs(inputs, device, dtype)
            control = inputs["control_latents"].to(device)
            control_image_input = control.repeat(2, 1, 1, 1, 1) if apply_cfg else control
            samples = controlnet(
                latent_list,
                timestep_model_input,
                embeds,
                control_image_input,
                conditioning_scale=float(inputs["control_scale"]),
            )
        places = list(samples)
        return {
            "controlnet_block_samples": [samples[p] for p in places],
            "controlnet_layer_places": torch.tensor(places, dtype=torch.int64),
        }
