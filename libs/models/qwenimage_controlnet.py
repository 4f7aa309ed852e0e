"""The Qwen-Image ControlNet ModelFns: the ControlNet-only stretches of ``QwenImageControlNetPipeline``.

Each class mirrors one stretch of ``diffusers/pipelines/qwenimage/pipeline_qwenimage_controlnet.py``
(diffusers 0.42.1) and runs it on its own. The rest of that pipeline is ``QwenImagePipeline``'s,
served by the nodes of :mod:`libs.models.qwenimage` (``qwenimage.prepare_latents`` with
``generator_state`` bound, ``qwenimage.transformer`` with the block samples bound), so a ControlNet
workflow of both modules' nodes reproduces the monolithic pipeline's image bitwise:

===============================  ================================================================
ModelFn (``fn_name``)            what it mirrors
===============================  ================================================================
``qwenimage.control_encode``     the single-ControlNet block before ``prepare_latents``:
                                 ``prepare_image``, ``vae.encode`` *sampled with the request's
                                 generator*, ``(x - mean) * (1 / std)``, the frame axis moved in
                                 front of the channels, ``_pack_latents``, the prompt's dtype
``qwenimage.controlnet``         the ``self.controlnet(...)`` call of the loop body: once per step,
                                 on the positive prompt only (both true-CFG passes of the
                                 transformer add the same samples)
===============================  ================================================================

The generator trap, as in Flux's ControlNet pipeline: the control image's posterior is sampled with
the request's generator *before* the initial noise is drawn from it, so ``qwenimage.control_encode``
outputs the generator's state after its draw and ``qwenimage.prepare_latents`` continues from it.

The ControlNet's outputs (the paper, §5.2): ``controlnet_block_samples``, a list of [1, seq, dim]
tensors already multiplied by ``control_scale`` (the ControlNet's own ``conditioning_scale``
multiplication, ``controlnet_keep`` being 1 for guidance start/end (0, 1)). ``qwenimage.transformer``
declares it as a callback input and hands the forward a lazy list that is first read after main
block 0, where ``QwenImageTransformer2DModel.forward`` adds sample ``i // interval_control`` after
block ``i``; so the fetch overlaps the embedders and one block.

Not mirrored: ``QwenImageMultiControlNetModel`` (several ControlNets), control guidance start/end
other than (0, 1), and ``QwenImageControlNetInpaintPipeline`` (a ControlNet with
``extra_condition_channels``, refused at load). LoRA: the pipeline's ``load_lora_weights`` loads
into the transformer only, so the ControlNet runs without the request's adapter, as here.

No torch, diffusers or transformers at import time. ``load_model`` puts the models on its device;
``qwenimage.control_encode`` samples with a CPU generator (the posterior's ``randn_tensor`` draws on
the generator's device, then moves).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libs.models.common import config_dtype, load_component, run_dtype, with_loads
from libs.models.qwenimage_latents import _pack_latents, _vae_config, _vae_scale_factor
from libs.models.qwenimage_loading import rope_tables_on_cpu
from libs.workflow.modelfn import ModelFn


def _require_controlnet_pipeline(model_path: str, fn_name: str) -> None:
    if not (Path(model_path) / "controlnet" / "config.json").is_file():
        raise ValueError(
            f"{fn_name} needs a QwenImageControlNetPipeline folder (with controlnet/), not {model_path}"
        )


class QwenImageControlEncode(ModelFn):
    """The control image as packed latents: ``control_latents`` [1, seq, 4z] in the prompt's dtype,
    and ``generator_state``, the request generator's state after the posterior sample (for
    ``qwenimage.prepare_latents``). Loads the VAE."""

    fn_name = "qwenimage.control_encode"

    def setup_io(self) -> None:
        self.add_input("control_image")
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_output("control_latents")
        self.add_output("generator_state")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from diffusers.image_processor import VaeImageProcessor

        _require_controlnet_pipeline(model_path, self.fn_name)
        vae = load_component(AutoencoderKLQwenImage, model_path, "vae", device, loader)
        transformer_config = QwenImageTransformer2DModel.load_config(model_path, subfolder="transformer")
        return with_loads(
            {
                "vae": vae,
                "image_processor": VaeImageProcessor(vae_scale_factor=_vae_scale_factor(vae.config) * 2),
                "num_channels_latents": int(transformer_config["in_channels"]) // 4,
                # .to(dtype=prompt_embeds.dtype): the text encoder's
                "dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, processor = components["vae"], components["image_processor"]
        image = inputs["control_image"]
        if image is None:
            raise ValueError("qwenimage.control_encode needs a control_image")
        height, width = int(inputs["height"]), int(inputs["width"])
        with torch.no_grad():
            # The request's generator, seeded as the pipeline's caller seeds it.
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            # prepare_image (batch 1, no CFG doubling), then the 5-D frame axis
            if not isinstance(image, torch.Tensor):
                image = processor.preprocess(image, height=height, width=width)
            image = image.repeat_interleave(1, dim=0).to(device=vae.device, dtype=vae.dtype)
            if image.ndim == 4:
                image = image.unsqueeze(2)
            z = int(vae.config.z_dim)
            mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(vae.device)
            inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(vae.device)
            # retrieve_latents(..., generator): the posterior sample, the generator's first draw
            control = vae.encode(image).latent_dist.sample(generator)
            control = (control - mean) * inverse_std
            control = control.permute(0, 2, 1, 3, 4)
            channels = components["num_channels_latents"]
            control = _pack_latents(control, channels, control.shape[3], control.shape[4])
            control = control.to(dtype=components["dtype"])
        return {"control_latents": control, "generator_state": generator.get_state()}


class QwenImageControlNet(ModelFn):
    """One step of the Qwen-Image ControlNet: ``controlnet_block_samples``, a list of [1, seq, dim]
    (times ``control_scale``); see the module docstring."""

    fn_name = "qwenimage.controlnet"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("height")
        self.add_input("width")
        self.add_input("prompt_embeds")
        self.add_input("prompt_embeds_mask")
        self.add_input("control_latents")
        self.add_input("control_scale")
        self.add_output("controlnet_block_samples")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import QwenImageControlNetModel

        _require_controlnet_pipeline(model_path, self.fn_name)
        with rope_tables_on_cpu():
            controlnet = load_component(QwenImageControlNetModel, model_path, "controlnet", device, loader)
        if int(controlnet.config.extra_condition_channels):
            raise ValueError(
                "qwenimage.controlnet: an inpainting ControlNet (extra_condition_channels) is not supported"
            )
        return with_loads(
            {"controlnet": controlnet, "vae_scale_factor": _vae_scale_factor(_vae_config(model_path))}
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        controlnet, factor = components["controlnet"], components["vae_scale_factor"]
        device = controlnet.device
        latents = inputs["latents"].to(device)
        height, width = int(inputs["height"]), int(inputs["width"])
        mask = inputs["prompt_embeds_mask"]
        with torch.no_grad():
            t = inputs["timesteps"].to(device)[int(inputs["step"])]
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            samples = controlnet(
                hidden_states=latents,
                controlnet_cond=inputs["control_latents"].to(device),
                conditioning_scale=float(inputs["control_scale"]),
                timestep=timestep / 1000,
                encoder_hidden_states=inputs["prompt_embeds"].to(device),
                # encode_prompt drops an all-ones mask
                encoder_hidden_states_mask=None if mask.all() else mask.to(device),
                img_shapes=[(1, height // factor // 2, width // factor // 2)],
                return_dict=False,
            )
        if samples is None:
            raise ValueError("qwenimage.controlnet: the ControlNet has no blocks")
        return {"controlnet_block_samples": list(samples)}
