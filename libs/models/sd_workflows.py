"""Stable Diffusion 1.5 workflows, composed from the ``sd.*`` ModelFns (paper Fig. 7).

Four workflows over the random-weight family of :mod:`libs.models.tiny_sd` (the same compositions
serve a real SD1.5 checkpoint and ControlNet by pointing ``model``/``controlnet`` at them):

* ``tiny-sd15``: text encoder (prompt and negative prompt, CFG), latent preparation, per step the
  UNet then the DDIM step, VAE decode.
* ``tiny-sd15-controlnet``: plus the control image's preprocessing once, and per step the ControlNet
  *beside* the UNet (both read the previous latents); the UNet takes the ControlNet's residuals as
  callback inputs, bound by name.
* ``tiny-sd15-lora`` / ``tiny-sd15-controlnet-lora``: the same with ``lora`` and ``lora_scale``
  parameters, bound by name to the UNet's optional inputs (the adapter is switched per request on
  a warm executor, never fused).

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

from libs.models.sd import (
    SdControlImage,
    SdControlNet,
    SdDdimStep,
    SdPrepareLatents,
    SdTextEncoder,
    SdUnet,
    SdVaeDecode,
)
from libs.workflow.compose import Value, Workflow
from libs.workflow.modelfn import ModelFn
from libs.workflow.spec import ParamSpec, WorkflowSpec

MODELFNS: list[type[ModelFn]] = [
    SdTextEncoder,
    SdPrepareLatents,
    SdControlImage,
    SdControlNet,
    SdUnet,
    SdDdimStep,
    SdVaeDecode,
]

TINY_SIZES = ["64x64", "128x128", "64x128", "128x64"]


def sd_params(
    *, width: int, height: int, steps: int, lora: bool = False, control: bool = False
) -> dict[str, ParamSpec]:
    params = {
        "prompt": ParamSpec(type="str", required=True, max_length=4000, description="what to draw"),
        "negative_prompt": ParamSpec(type="str", default="", max_length=4000, description="what not to draw"),
        "seed": ParamSpec(type="int", default=0, minimum=0, description="seed of the initial noise"),
        "width": ParamSpec(type="int", default=width, minimum=8, maximum=2048, description="a multiple of 8"),
        "height": ParamSpec(
            type="int", default=height, minimum=8, maximum=2048, description="a multiple of 8"
        ),
        "num_inference_steps": ParamSpec(type="int", default=steps, minimum=1, maximum=100),
        # StableDiffusionPipeline's default; > 1 turns classifier-free guidance on
        "guidance_scale": ParamSpec(type="float", default=7.5, minimum=0.0, maximum=30.0),
    }
    if lora:
        params["lora"] = ParamSpec(type="lora", default="", description="a UNet LoRA adapter")
        params["lora_scale"] = ParamSpec(type="float", default=1.0, minimum=0.0, maximum=2.0)
    if control:
        params["control_image"] = ParamSpec(
            type="image", required=True, description="the ControlNet's condition"
        )
        # StableDiffusionControlNetPipeline's controlnet_conditioning_scale default
        params["control_scale"] = ParamSpec(type="float", default=1.0, minimum=0.0, maximum=2.0)
    return params


def sd_workflow(
    name: str,
    model: str,
    *,
    controlnet: str | None = None,
    lora: bool = False,
    sizes: list[str],
    steps: int = 4,
    description: str = "",
) -> WorkflowSpec:
    """An SD1.5 workflow on the pipeline folder ``model``; with ``controlnet`` (a ControlNetModel
    folder) it conditions on a ``control_image`` parameter; with ``lora`` it takes an adapter."""
    width, height = (int(x) for x in sizes[0].split("x"))
    text_encoder = SdTextEncoder(model, id="text_encoder")
    prepare = SdPrepareLatents(model, id="prepare")
    unet = SdUnet(model, id="unet")
    ddim = SdDdimStep(model, id="ddim")
    vae = SdVaeDecode(model, id="vae")
    control_image = SdControlImage(model, id="control_image") if controlnet else None
    control = SdControlNet(controlnet, id="controlnet") if controlnet else None
    params = sd_params(width=width, height=height, steps=steps, lora=lora, control=controlnet is not None)
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        text_encoder()  # prompt, negative_prompt, guidance_scale: bound by name to the parameters
        init = prepare()  # seed, height, width, num_inference_steps
        if control_image is not None:
            control_image()  # control_image, height, width -> control_cond

        def denoise(step: Value, latents: Value) -> Value:
            if control is not None:
                # Beside the UNet: both read this step's latents. The UNet's callback inputs
                # (down_block_res_samples, mid_block_res_sample) bind to these outputs by name.
                control(latents=latents)
            noise_pred = unet(latents=latents)  # lora/lora_scale by name when the workflow has them
            return ddim(noise_pred=noise_pred, latents=latents)

        latents = wf.loop("num_inference_steps", denoise, id="denoise", latents=init.latents)
        wf.output("image", vae(latents=latents))
    return wf.spec()


def tiny_sd15(model: str = "tiny-sd15") -> WorkflowSpec:
    return sd_workflow(
        "tiny-sd15",
        model,
        sizes=TINY_SIZES,
        description="SD1.5-style workflow (CLIP, UNet with CFG, DDIM, VAE) with random-weight tiny components",
    )


def tiny_sd15_controlnet(model: str = "tiny-sd15", controlnet: str = "tiny-sd15-controlnet") -> WorkflowSpec:
    return sd_workflow(
        "tiny-sd15-controlnet",
        model,
        controlnet=controlnet,
        sizes=TINY_SIZES,
        description="tiny-sd15 with a ControlNet run beside the UNet every step",
    )


def tiny_sd15_lora(model: str = "tiny-sd15") -> WorkflowSpec:
    return sd_workflow(
        "tiny-sd15-lora",
        model,
        lora=True,
        sizes=TINY_SIZES,
        description="tiny-sd15 with a per-request UNet LoRA (e.g. loras/tiny-sd15-style.safetensors)",
    )


def tiny_sd15_controlnet_lora(
    model: str = "tiny-sd15", controlnet: str = "tiny-sd15-controlnet"
) -> WorkflowSpec:
    return sd_workflow(
        "tiny-sd15-controlnet-lora",
        model,
        controlnet=controlnet,
        lora=True,
        sizes=TINY_SIZES,
        description="tiny-sd15 with a ControlNet and a per-request UNet LoRA",
    )


BUILTIN = {
    "tiny-sd15": tiny_sd15,
    "tiny-sd15-controlnet": tiny_sd15_controlnet,
    "tiny-sd15-lora": tiny_sd15_lora,
    "tiny-sd15-controlnet-lora": tiny_sd15_controlnet_lora,
}


def workflows() -> list[WorkflowSpec]:
    return [make() for make in BUILTIN.values()]
