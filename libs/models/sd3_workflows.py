"""Stable Diffusion 3 workflows, composed from the ``sd3.*`` ModelFns (the paper, §4, Fig. 7).

* ``tiny-sd3``: CLIP pair and T5 as parallel nodes, the join of their embeddings, latent
  preparation, the transformer (CFG batched ``[uncond, cond]`` inside) then the flow-match Euler step
  once per denoising step, then VAE decode.
* ``tiny-sd3-controlnet``: plus the control image's VAE encoding before the loop and the ControlNet as
  its own node every step, beside the transformer, which takes its block samples as a callback input.
* ``tiny-sd3-lora`` / ``tiny-sd3-controlnet-lora``: the same with ``lora``/``lora_scale`` parameters,
  bound by name to the transformer's optional inputs.

The base nodes of all four name the same model (``tiny-sd3``), so one warm transformer serves them all;
the ControlNet node names the standalone ControlNet (``tiny-sd3-controlnet``). The components are
random-weight models built from configs (:func:`libs.models.tiny_sd3.build`); the same compositions serve
real checkpoints by pointing ``model``/``controlnet`` at them (pass the ControlNet's
``force_zeros_for_pooled_projection``: ``sd3.controlnet`` refuses a value its config contradicts). The
four variants come from :func:`libs.models.common.variant_workflows`.

``tiny-sd3-img2img`` and ``tiny-sd3-inpaint`` (:func:`sd3_edit_workflow`) start from an ``image``:
``StableDiffusion3Img2ImgPipeline`` and ``StableDiffusion3InpaintPipeline``, whose loop runs only the
last steps of the schedule (``strength``); the inpainting one blends the kept region back after every
Euler step (:mod:`libs.models.sd3_img2img`).

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

from libs.models.common import Variant, controlnet_params, edit_params, lora_params, variant_workflows
from libs.models.sd3 import (
    SD3ClipEncoder,
    SD3FlowMatchStep,
    SD3JoinPromptEmbeds,
    SD3PrepareLatents,
    SD3T5Encoder,
    SD3Transformer,
    SD3VaeDecode,
)
from libs.models.sd3_controlnet import SD3ControlImage, SD3ControlNet
from libs.models.sd3_img2img import SD3InpaintBlend, SD3InpaintLatents, SD3InpaintVaeDecode, SD3VaeEncode
from libs.workflow.compose import Value, Workflow
from libs.workflow.modelfn import ModelFn
from libs.workflow.spec import ParamSpec, WorkflowSpec

MODELFNS: list[type[ModelFn]] = [
    SD3ClipEncoder,
    SD3T5Encoder,
    SD3JoinPromptEmbeds,
    SD3PrepareLatents,
    SD3Transformer,
    SD3FlowMatchStep,
    SD3VaeDecode,
    SD3ControlImage,
    SD3ControlNet,
    SD3VaeEncode,
    SD3InpaintLatents,
    SD3InpaintBlend,
    SD3InpaintVaeDecode,
]

TINY_SIZES = ["128x128", "64x64", "256x256", "128x64", "64x128"]
DESCRIPTION = "tiny SD3 (random-weight CLIP-L/G + T5, MMDiT with CFG, VAE)"


def sd3_params(
    *, width: int, height: int, steps: int, max_sequence_length: int, guidance_scale: float = 7.0
) -> dict[str, ParamSpec]:
    """The parameters of the basic SD3 workflow (:func:`sd3_workflow` adds a variant's); defaults
    follow ``StableDiffusion3Pipeline.__call__``'s (guidance 7.0) except size, steps and sequence
    length."""
    params = {
        "prompt": ParamSpec(type="str", required=True, max_length=4000, description="what to draw"),
        "negative_prompt": ParamSpec(type="str", default="", max_length=4000, description="what not to draw"),
        "seed": ParamSpec(type="int", default=0, minimum=0, description="seed of the initial noise"),
        "width": ParamSpec(type="int", default=width, minimum=16, maximum=2048),
        "height": ParamSpec(type="int", default=height, minimum=16, maximum=2048),
        "num_inference_steps": ParamSpec(type="int", default=steps, minimum=1, maximum=100),
        "guidance_scale": ParamSpec(
            type="float",
            default=guidance_scale,
            minimum=0.0,
            maximum=30.0,
            description="CFG; 1 or less: none",
        ),
        "max_sequence_length": ParamSpec(type="int", default=max_sequence_length, minimum=1, maximum=512),
    }
    return params


def sd3_workflow(
    name: str,
    model: str,
    *,
    sizes: list[str],
    controlnet: str | None = None,
    force_zeros_for_pooled_projection: bool = True,
    lora: bool = False,
    steps: int = 4,
    max_sequence_length: int = 32,
    description: str = "",
) -> WorkflowSpec:
    """An SD3 text-to-image workflow on ``model``; with ``controlnet`` (a model reference) a ControlNet
    workflow whose ControlNet config has ``force_zeros_for_pooled_projection``; ``lora``: LoRA params."""
    width, height = (int(x) for x in sizes[0].split("x"))
    clip = SD3ClipEncoder(model, id="clip")
    t5 = SD3T5Encoder(model, id="t5")
    join = SD3JoinPromptEmbeds(model, id="join")
    prepare = SD3PrepareLatents(model, id="prepare")
    transformer = SD3Transformer(model, id="transformer")
    euler = SD3FlowMatchStep(model, id="euler")
    vae = SD3VaeDecode(model, id="vae")
    params = sd3_params(width=width, height=height, steps=steps, max_sequence_length=max_sequence_length)
    if controlnet is not None:
        params.update(controlnet_params())
    if lora:
        params.update(lora_params())
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        clip()  # prompt, negative_prompt, guidance_scale: bound by name to the parameters
        t5()  # ... and max_sequence_length
        join()  # clip_prompt_embeds, t5_prompt_embeds -> prompt_embeds
        init = prepare()  # seed, height, width, num_inference_steps
        if controlnet is not None:
            control_image = SD3ControlImage(model, id="control_image")  # the base model's VAE
            control_net = SD3ControlNet(controlnet, id="controlnet")
            control_image(force_zeros_for_pooled_projection=force_zeros_for_pooled_projection)

        def denoise(step: Value, latents: Value) -> Value:
            # Everything else (embeddings, timesteps, guidance, control latents, lora) is bound by name;
            # the transformer's optional control_block_samples binds to the ControlNet's output when
            # there is one, and its lora/lora_scale to the parameters when the workflow has them.
            if controlnet is not None:
                control_net(
                    latents=latents, force_zeros_for_pooled_projection=force_zeros_for_pooled_projection
                )
            noise_pred = transformer(latents=latents)
            return euler(noise_pred=noise_pred, latents=latents)

        latents = wf.loop("num_inference_steps", denoise, id="denoise", latents=init.latents)
        wf.output("image", vae(latents=latents))
    return wf.spec()


def workflows(model: str = "tiny-sd3", controlnet: str = "tiny-sd3-controlnet") -> list[WorkflowSpec]:
    """The tiny SD3 family: plain, with ControlNet, LoRA or both, composed on the tiny models' names
    (:func:`libs.models.tiny_sd3.build` builds them)."""

    def compose(name: str, variant: Variant, description: str) -> WorkflowSpec:
        return sd3_workflow(
            name,
            model,
            sizes=TINY_SIZES,
            controlnet=controlnet if variant.controlnet else None,
            lora=variant.lora,
            description=description,
        )

    return [
        *variant_workflows("tiny-sd3", DESCRIPTION, compose),
        sd3_edit_workflow(
            "tiny-sd3-img2img", model, inpaint=False, sizes=TINY_SIZES, description=DESCRIPTION + ", img2img"
        ),
        sd3_edit_workflow(
            "tiny-sd3-inpaint",
            model,
            inpaint=True,
            sizes=TINY_SIZES,
            description=DESCRIPTION + ", inpainting",
        ),
    ]


def sd3_edit_workflow(
    name: str,
    model: str,
    *,
    inpaint: bool,
    sizes: list[str],
    steps: int = 4,
    max_sequence_length: int = 32,
    description: str = "",
) -> WorkflowSpec:
    """An SD3 image-to-image workflow on ``model`` (with ``inpaint``, the inpainting pipeline's),
    taking :func:`~libs.models.common.edit_params` at the pipelines' default strength, 0.6."""
    width, height = (int(x) for x in sizes[0].split("x"))
    clip = SD3ClipEncoder(model, id="clip")
    t5 = SD3T5Encoder(model, id="t5")
    join = SD3JoinPromptEmbeds(model, id="join")
    prepare: SD3InpaintLatents | SD3VaeEncode = (
        SD3InpaintLatents(model, id="prepare") if inpaint else SD3VaeEncode(model, id="prepare")
    )
    transformer = SD3Transformer(model, id="transformer")
    euler = SD3FlowMatchStep(model, id="euler")
    blend = SD3InpaintBlend(model, id="blend")
    # StableDiffusion3InpaintPipeline decodes without adding the VAE's shift_factor back
    vae = SD3InpaintVaeDecode(model, id="vae") if inpaint else SD3VaeDecode(model, id="vae")
    params = sd3_params(width=width, height=height, steps=steps, max_sequence_length=max_sequence_length)
    params.update(edit_params(strength=0.6, inpaint=inpaint))
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        clip()
        t5()
        join()
        init = prepare()  # image (and mask), seed, height, width, num_inference_steps, strength

        def denoise(step: Value, latents: Value) -> Value:
            noise_pred = transformer(latents=latents)
            latents = euler(noise_pred=noise_pred, latents=latents)
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
