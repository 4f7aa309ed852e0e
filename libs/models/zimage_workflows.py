"""Z-Image workflows, composed from the ``zimage.*`` ModelFns (the paper, §4, Fig. 7).

* ``tiny-zimage``: the Qwen3 text encoder (prompt and, with guidance, negative prompt), latent
  preparation, then once per denoising step the Z-Image transformer (classifier-free guidance in
  one batched pass) and the flow-match Euler step, then the VAE decode.
* ``tiny-zimage-turbo``: the same composition on the Turbo folder (a fixed-shift scheduler) with
  Z-Image-Turbo's defaults. Those are the ones ``ZImagePipeline``'s own usage example (its
  ``EXAMPLE_DOC_STRING``, which loads the Turbo checkpoint) passes: ``num_inference_steps=8`` and
  ``guidance_scale=0.0``, i.e. no classifier-free guidance (the distilled model needs none; the
  negative prompt is then not encoded). The pipeline's ``__call__`` defaults (50 steps, guidance
  5.0) are base Z-Image's.
* ``-controlnet``: the same on the ``ZImageControlNetPipeline`` folder (every node runs on it),
  plus ``zimage.control_encode`` once and ``zimage.controlnet`` once per step, in parallel with the
  transformer, which fetches the ControlNet's block samples inside its forward (callback inputs).
  Parameters ``control_image`` and ``control_scale`` (the pipeline's
  ``controlnet_conditioning_scale``; its default there is 0.75, here 1.0 as in every family).
* ``-lora`` / ``-controlnet-lora``: the same with the ``lora`` and ``lora_scale`` parameters, which
  the transformer (and the ControlNet, whose refiners are the transformer's) bind by name.

The variants of each checkpoint come from :func:`libs.models.common.variant_workflows`.

``tiny-zimage-img2img`` and ``tiny-zimage-inpaint`` (:func:`zimage_edit_workflow`, on the base
folder) start from an ``image``: ``ZImageImg2ImgPipeline`` and ``ZImageInpaintPipeline``, whose loop
runs only the last steps of the schedule (``strength``); the inpainting one blends the kept region
back after every Euler step (:mod:`libs.models.zimage_img2img`).

Parameters are ``ZImagePipeline.__call__``'s (``cfg_normalization`` as a float, 0 = the
pipeline's ``False``), with its defaults except where the tiny model needs its own (steps, max
sequence length). Sizes must divide by 16 (``vae_scale_factor * 2``).

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

from libs.models.common import Variant, controlnet_params, edit_params, lora_params, variant_workflows
from libs.models.zimage import (
    ZImagePrepareLatents,
    ZImageSchedulerStep,
    ZImageTextEncoder,
    ZImageTransformer,
    ZImageVaeDecode,
)
from libs.models.zimage_controlnet import ZImageControlEncode, ZImageControlNet
from libs.models.zimage_img2img import ZImageInpaintBlend, ZImageInpaintLatents, ZImageVaeEncode
from libs.workflow.compose import Value, Workflow
from libs.workflow.modelfn import ModelFn
from libs.workflow.spec import ParamSpec, WorkflowSpec

# Every Z-Image ModelFn (libs.models.zimage and libs.models.zimage_controlnet), for the catalog
# (entry points) and tests.
MODELFNS: list[type[ModelFn]] = [
    ZImageTextEncoder,
    ZImagePrepareLatents,
    ZImageControlEncode,
    ZImageControlNet,
    ZImageTransformer,
    ZImageSchedulerStep,
    ZImageVaeDecode,
    ZImageVaeEncode,
    ZImageInpaintLatents,
    ZImageInpaintBlend,
]

TINY_SIZES = ["64x64", "128x128", "96x64", "64x96"]
BASE = "tiny Z-Image (random-weight Qwen3 encoder, single-stream DiT with CFG, VAE)"
TURBO = "tiny Z-Image-Turbo (8 steps, no guidance)"


def zimage_params(
    *, width: int, height: int, steps: int, max_sequence_length: int, guidance_scale: float = 5.0
) -> dict[str, ParamSpec]:
    """The parameters of the basic Z-Image workflow (:func:`zimage_workflow` adds LoRA's)."""
    return {
        "prompt": ParamSpec(type="str", required=True, max_length=4000, description="what to draw"),
        "negative_prompt": ParamSpec(type="str", default="", max_length=4000, description="what not to draw"),
        "seed": ParamSpec(type="int", default=0, minimum=0, description="seed of the initial noise"),
        "width": ParamSpec(type="int", default=width, minimum=16, maximum=4096),
        "height": ParamSpec(type="int", default=height, minimum=16, maximum=4096),
        "num_inference_steps": ParamSpec(type="int", default=steps, minimum=1, maximum=100),
        "guidance_scale": ParamSpec(
            type="float",
            default=guidance_scale,
            minimum=0.0,
            maximum=30.0,
            description="classifier-free guidance iff > 0",
        ),
        "cfg_normalization": ParamSpec(
            type="float",
            default=0.0,
            minimum=0.0,
            maximum=10.0,
            description="cap the guided prediction's norm at this multiple of the positive one's; 0: off",
        ),
        "cfg_truncation": ParamSpec(
            type="float",
            default=1.0,
            minimum=0.0,
            maximum=1.0,
            description="no guidance once the normalised time (1000 - t) / 1000 exceeds this",
        ),
        "max_sequence_length": ParamSpec(type="int", default=max_sequence_length, minimum=1, maximum=1024),
    }


def zimage_workflow(
    name: str,
    model: str,
    *,
    sizes: list[str],
    steps: int = 50,
    max_sequence_length: int = 512,
    guidance_scale: float = 5.0,
    controlnet: bool = False,
    lora: bool = False,
    description: str = "",
) -> WorkflowSpec:
    """A Z-Image text-to-image workflow on the ``ZImagePipeline`` folder ``model`` (a
    ``ZImageControlNetPipeline`` one for ``controlnet``); ``lora`` adds the LoRA parameters.
    Defaults are ``ZImagePipeline.__call__``'s."""
    width, height = (int(x) for x in sizes[0].split("x"))
    text = ZImageTextEncoder(model, id="text")
    prepare = ZImagePrepareLatents(model, id="prepare")
    transformer = ZImageTransformer(model, id="transformer")
    scheduler = ZImageSchedulerStep(model, id="scheduler")
    vae = ZImageVaeDecode(model, id="vae")
    params = zimage_params(
        width=width,
        height=height,
        steps=steps,
        max_sequence_length=max_sequence_length,
        guidance_scale=guidance_scale,
    )
    if controlnet:
        params.update(controlnet_params())
    if lora:
        params.update(lora_params())
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        text()  # prompt, negative_prompt, guidance_scale, max_sequence_length
        init = prepare()  # seed, height, width, num_inference_steps
        if controlnet:
            ZImageControlEncode(model, id="control")()  # control_image, height, width

        def denoise(step: Value, latents: Value) -> Value:
            if controlnet:
                ZImageControlNet(model, id="controlnet")(latents=latents)
            # embeddings, timesteps, guidance, the ControlNet's outputs, lora, lora_scale: by name
            noise_pred = transformer(latents=latents)
            return scheduler(noise_pred=noise_pred, latents=latents)

        latents = wf.loop("num_inference_steps", denoise, id="denoise", latents=init.latents)
        wf.output("image", vae(latents=latents))
    return wf.spec()


def workflows(
    model: str = "tiny-zimage",
    turbo: str = "tiny-zimage-turbo",
    controlnet: str = "tiny-zimage-controlnet",
    turbo_controlnet: str = "tiny-zimage-turbo-controlnet",
) -> list[WorkflowSpec]:
    """The tiny Z-Image family: base and Turbo, each plain, with ControlNet, LoRA or both. The
    folders are ``ZImagePipeline`` ones and, for the ControlNet variants, ``ZImageControlNetPipeline``
    ones; :func:`libs.models.tiny_zimage.build` builds all four."""
    out: list[WorkflowSpec] = []
    for name, folders, steps, guidance, description in (
        ("tiny-zimage", (model, controlnet), 4, 5.0, BASE),
        ("tiny-zimage-turbo", (turbo, turbo_controlnet), 8, 0.0, TURBO),
    ):

        def compose(
            workflow: str,
            variant: Variant,
            text: str,
            folders: tuple[str, str] = folders,
            steps: int = steps,
            guidance: float = guidance,
        ) -> WorkflowSpec:
            return zimage_workflow(
                workflow,
                folders[1] if variant.controlnet else folders[0],
                sizes=TINY_SIZES,
                steps=steps,
                max_sequence_length=96,
                guidance_scale=guidance,
                controlnet=variant.controlnet,
                lora=variant.lora,
                description=text,
            )

        out += variant_workflows(name, description, compose)
    out += [
        zimage_edit_workflow("tiny-zimage-img2img", model, inpaint=False, description=BASE + ", img2img"),
        zimage_edit_workflow("tiny-zimage-inpaint", model, inpaint=True, description=BASE + ", inpainting"),
    ]
    return out


def zimage_edit_workflow(
    name: str,
    model: str,
    *,
    inpaint: bool,
    sizes: list[str] = TINY_SIZES,
    steps: int = 4,
    max_sequence_length: int = 96,
    description: str = "",
) -> WorkflowSpec:
    """A Z-Image image-to-image workflow on the ``ZImagePipeline`` folder ``model`` (with
    ``inpaint``, the inpainting pipeline's), taking :func:`~libs.models.common.edit_params` at the
    pipelines' default strength (0.6 for img2img, 1.0 for inpainting)."""
    width, height = (int(x) for x in sizes[0].split("x"))
    text = ZImageTextEncoder(model, id="text")
    prepare: ZImageVaeEncode = (
        ZImageInpaintLatents(model, id="prepare") if inpaint else ZImageVaeEncode(model, id="prepare")
    )
    transformer = ZImageTransformer(model, id="transformer")
    scheduler = ZImageSchedulerStep(model, id="scheduler")
    blend = ZImageInpaintBlend(model, id="blend")
    vae = ZImageVaeDecode(model, id="vae")
    params = zimage_params(width=width, height=height, steps=steps, max_sequence_length=max_sequence_length)
    params.update(edit_params(strength=1.0 if inpaint else 0.6, inpaint=inpaint))
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        text()
        init = prepare()  # image (and mask), seed, height, width, num_inference_steps, strength

        def denoise(step: Value, latents: Value) -> Value:
            noise_pred = transformer(latents=latents)
            latents = scheduler(noise_pred=noise_pred, latents=latents)
            # image_latents, noise, init_mask: the preparation's, bound by name
            return blend(latents=latents) if inpaint else latents

        latents = wf.loop(
            "num_inference_steps",
            denoise,
            id="denoise",
            fraction="strength",
            rounding="start",
            latents=init.latents,
        )
        wf.output("image", vae(latents=latents))
    return wf.spec()
