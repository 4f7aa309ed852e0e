"""Stable Diffusion 1.5 workflows, composed from the ``sd.*`` ModelFns (the paper, §4, Fig. 7).

Four workflows over the random-weight family of :mod:`libs.models.tiny_sd` (the same compositions
serve a real SD1.5 checkpoint and ControlNet by pointing ``model``/``controlnet`` at them), generated
as the four variants of :func:`libs.models.common.variant_workflows`:

* ``tiny-sd15``: text encoder (prompt and negative prompt, CFG), latent preparation, per step the
  UNet then the DDIM step, VAE decode.
* ``tiny-sd15-controlnet``: plus the control image's preprocessing once, and per step the ControlNet
  *beside* the UNet (both read the previous latents); the UNet takes the ControlNet's residuals as
  callback inputs, bound by name.
* ``tiny-sd15-lora`` / ``tiny-sd15-controlnet-lora``: the same with ``lora`` and ``lora_scale``
  parameters, bound by name to the UNet's optional inputs (the adapter is switched per request on
  a warm executor, never fused).

And two that start from a picture (:func:`sd_edit_workflow`, :mod:`libs.models.sd_img2img`):

* ``tiny-sd15-img2img``: ``StableDiffusionImg2ImgPipeline``: the picture VAE-encoded and noised,
  then only the last ``int(num_inference_steps * strength)`` steps of the loop.
* ``tiny-sd15-inpaint``: ``StableDiffusionInpaintPipeline`` with the family's 4-channel UNet: the
  same shortened loop, each step's DDIM update followed by the blend that keeps the unmasked region.

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

from libs.models.common import Variant, controlnet_params, edit_params, lora_params, variant_workflows
from libs.models.sd import SdDdimStep, SdPrepareLatents, SdTextEncoder, SdUnet, SdVaeDecode
from libs.models.sd_controlnet import SdControlImage, SdControlNet
from libs.models.sd_img2img import SdInpaintBlend, SdInpaintLatents, SdVaeEncode
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
    SdVaeEncode,
    SdInpaintLatents,
    SdInpaintBlend,
]

TINY_SIZES = ["64x64", "128x128", "64x128", "128x64"]
DESCRIPTION = "tiny SD1.5 (random-weight CLIP, UNet with CFG, DDIM, VAE)"


def sd_params(*, width: int, height: int, steps: int) -> dict[str, ParamSpec]:
    """The parameters of the basic workflow (:func:`sd_workflow` adds a variant's)."""
    return {
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
    params = sd_params(width=width, height=height, steps=steps)
    if controlnet:
        params.update(controlnet_params())
    if lora:
        params.update(lora_params())
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


def workflows(model: str = "tiny-sd15", controlnet: str = "tiny-sd15-controlnet") -> list[WorkflowSpec]:
    """The tiny SD1.5 family: plain, with ControlNet, LoRA or both; model names are folders under the
    executors' model root (:func:`libs.models.tiny_sd.build` builds them)."""

    def compose(name: str, variant: Variant, description: str) -> WorkflowSpec:
        return sd_workflow(
            name,
            model,
            controlnet=controlnet if variant.controlnet else None,
            lora=variant.lora,
            sizes=TINY_SIZES,
            description=description,
        )

    return [
        *variant_workflows("tiny-sd15", DESCRIPTION, compose),
        sd_edit_workflow(
            "tiny-sd15-img2img", model, inpaint=False, sizes=TINY_SIZES, description=DESCRIPTION + ", img2img"
        ),
        sd_edit_workflow(
            "tiny-sd15-inpaint",
            model,
            inpaint=True,
            sizes=TINY_SIZES,
            description=DESCRIPTION + ", inpainting",
        ),
    ]


def sd_edit_workflow(
    name: str, model: str, *, inpaint: bool, sizes: list[str], steps: int = 4, description: str = ""
) -> WorkflowSpec:
    """An SD1.5 image-to-image workflow on the pipeline folder ``model`` (with ``inpaint``, the
    inpainting pipeline's), taking the ``image``, ``mask`` and ``strength`` of
    :func:`~libs.models.common.edit_params` at the pipeline's default strength."""
    width, height = (int(x) for x in sizes[0].split("x"))
    text_encoder = SdTextEncoder(model, id="text_encoder")
    prepare: SdInpaintLatents | SdVaeEncode = (
        SdInpaintLatents(model, id="prepare") if inpaint else SdVaeEncode(model, id="prepare")
    )
    unet = SdUnet(model, id="unet")
    ddim = SdDdimStep(model, id="ddim")
    blend = SdInpaintBlend(model, id="blend")
    vae = SdVaeDecode(model, id="vae")
    params = sd_params(width=width, height=height, steps=steps)
    params.update(edit_params(strength=1.0 if inpaint else 0.8, inpaint=inpaint))
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        text_encoder()
        init = prepare()  # image (and mask), seed, height, width, num_inference_steps, strength

        def denoise(step: Value, latents: Value) -> Value:
            noise_pred = unet(latents=latents)
            latents = ddim(noise_pred=noise_pred, latents=latents)
            # image_latents, noise, init_mask: the preparation's, bound by name
            return blend(latents=latents) if inpaint else latents

        latents = wf.loop(
            "num_inference_steps", denoise, id="denoise", fraction="strength", latents=init.latents
        )
        wf.output("image", vae(latents=latents))
    return wf.spec()
