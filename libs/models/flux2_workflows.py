"""Flux.2 Klein workflows, composed from the ``flux2.*`` ModelFns (the paper, §4, Fig. 7).

* ``tiny-flux2-klein``: the Qwen3 text encoder (the prompt and, when guiding, the empty negative),
  latent preparation, the Flux.2 transformer (both guidance passes in one node) then the scheduler
  step once per denoising step, then the VAE decode.
* ``tiny-flux2-klein-lora``: the same with the ``lora`` and ``lora_scale`` parameters, which the
  transformer binds by name.
* ``tiny-flux2-klein-edit``: ``Flux2KleinPipeline`` with reference images, ``image`` and optionally
  ``image_2`` and ``image_3`` (the gateway's edit uploads fill them in order): ``flux2.reference_encode``
  turns them into reference tokens that the transformer binds by name; the output has the request's
  ``height`` and ``width`` (:mod:`libs.models.flux2_img2img`).
* ``tiny-flux2-klein-inpaint`` (:func:`flux2_inpaint_workflow`): ``Flux2KleinInpaintPipeline``, from
  an ``image`` and a ``mask``; its loop runs only the last steps of the schedule (``strength``), the
  transformer (the same ``flux2.transformer``) binds the picture's ``image_latents`` and
  ``image_latent_ids`` by name as reference tokens and the kept region is blended back after every
  step (:mod:`libs.models.flux2_img2img`).

Klein has no ControlNet pipeline (:mod:`libs.models.flux2_controlnet`), so of the four variants of
:func:`libs.models.common.variant_workflows` only the plain and LoRA ones exist.

Defaults are ``Flux2KleinPipeline.__call__``'s (``guidance_scale`` 4.0) except where the tiny model
needs its own (steps, max sequence length). ``guidance_scale`` only guides a Klein base checkpoint;
on a step-distilled one (``is_distilled``) the pipeline ignores it, and so do the nodes. The same
composition serves a real checkpoint by pointing ``model`` at it.

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

from libs.models.common import VARIANTS, Variant, edit_params, lora_params
from libs.models.flux2 import (
    Flux2PrepareLatents,
    Flux2SchedulerStep,
    Flux2TextEncoder,
    Flux2Transformer,
    Flux2VaeDecode,
)
from libs.models.flux2_img2img import Flux2InpaintBlend, Flux2InpaintLatents, Flux2ReferenceEncode
from libs.workflow.compose import Value, Workflow
from libs.workflow.modelfn import ModelFn
from libs.workflow.spec import ParamSpec, WorkflowSpec

# Every Flux.2 ModelFn (libs.models.flux2 and flux2_img2img; libs.models.flux2_controlnet has none),
# for the catalog (entry points) and tests.
MODELFNS: list[type[ModelFn]] = [
    Flux2TextEncoder,
    Flux2PrepareLatents,
    Flux2Transformer,
    Flux2SchedulerStep,
    Flux2VaeDecode,
    Flux2InpaintLatents,
    Flux2InpaintBlend,
    Flux2ReferenceEncode,
]

TINY_SIZES = ["128x128", "64x64", "256x256", "128x64", "64x128"]
DESCRIPTION = "tiny Flux.2 Klein base (random-weight Qwen3, Flux.2 DiT with CFG, Flux.2 VAE)"


def flux2_params(
    *, width: int, height: int, steps: int, max_sequence_length: int, guidance_scale: float = 4.0
) -> dict[str, ParamSpec]:
    """The parameters of the basic Klein workflow (:func:`flux2_workflow` adds LoRA's)."""
    return {
        "prompt": ParamSpec(type="str", required=True, max_length=4000, description="what to draw"),
        "seed": ParamSpec(type="int", default=0, minimum=0, description="seed of the initial noise"),
        "width": ParamSpec(type="int", default=width, minimum=16, maximum=4096),
        "height": ParamSpec(type="int", default=height, minimum=16, maximum=4096),
        "num_inference_steps": ParamSpec(type="int", default=steps, minimum=1, maximum=100),
        "guidance_scale": ParamSpec(
            type="float",
            default=guidance_scale,
            minimum=0.0,
            maximum=30.0,
            description="classifier-free guidance iff > 1 (ignored by step-distilled checkpoints)",
        ),
        "max_sequence_length": ParamSpec(type="int", default=max_sequence_length, minimum=1, maximum=1024),
    }


def reference_params() -> dict[str, ParamSpec]:
    """The reference pictures of a Klein edit: ``image`` and up to two more, in the order the
    gateway's edit uploads fill them; an optional picture left out resolves to ``""`` (none)."""
    return {
        "image": ParamSpec(type="image", required=True, description="the (first) reference picture, RGB"),
        "image_2": ParamSpec(type="image", description="a second reference picture, RGB; empty: none"),
        "image_3": ParamSpec(type="image", description="a third reference picture, RGB; empty: none"),
    }


def flux2_workflow(
    name: str,
    model: str,
    *,
    sizes: list[str],
    steps: int = 50,
    max_sequence_length: int = 512,
    guidance_scale: float = 4.0,
    lora: bool = False,
    edit: bool = False,
    description: str = "",
) -> WorkflowSpec:
    """A Flux.2 Klein text-to-image workflow on the ``Flux2KleinPipeline`` folder ``model``;
    ``lora`` adds the LoRA parameters, ``edit`` the reference pictures
    (:func:`reference_params`), which ``flux2.reference_encode`` hands the transformer."""
    width, height = (int(x) for x in sizes[0].split("x"))
    text = Flux2TextEncoder(model, id="text")
    prepare = Flux2PrepareLatents(model, id="prepare")
    transformer = Flux2Transformer(model, id="transformer")
    scheduler = Flux2SchedulerStep(model, id="scheduler")
    vae = Flux2VaeDecode(model, id="vae")
    params = flux2_params(
        width=width,
        height=height,
        steps=steps,
        max_sequence_length=max_sequence_length,
        guidance_scale=guidance_scale,
    )
    if lora:
        params.update(lora_params())
    if edit:
        params.update(reference_params())
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        text()  # prompt, guidance_scale, max_sequence_length
        init = prepare()  # seed, height, width, num_inference_steps
        if edit:
            Flux2ReferenceEncode(model, id="reference")()  # image, image_2, image_3

        def denoise(step: Value, latents: Value) -> Value:
            # prompt_embeds, text_ids, latent_ids, timesteps, guidance_scale, lora, lora_scale and
            # (editing) image_latents, image_latent_ids by name
            noise_pred = transformer(latents=latents)
            return scheduler(noise_pred=noise_pred, latents=latents)

        latents = wf.loop("num_inference_steps", denoise, id="denoise", latents=init.latents)
        wf.output("image", vae(latents=latents))
    return wf.spec()


def workflows(model: str = "tiny-flux2-klein") -> list[WorkflowSpec]:
    """The tiny Flux.2 Klein family: plain, with LoRA, reference-image edits and inpainting, on a
    ``Flux2KleinPipeline`` folder (:func:`libs.models.tiny_flux2.build` builds it)."""

    def compose(variant: Variant) -> WorkflowSpec:
        return flux2_workflow(
            "tiny-flux2-klein" + variant.suffix,
            model,
            sizes=TINY_SIZES,
            steps=4,
            max_sequence_length=96,
            lora=variant.lora,
            description=variant.describe(DESCRIPTION),
        )

    return [
        *(compose(v) for v in VARIANTS if not v.controlnet),
        flux2_workflow(
            "tiny-flux2-klein-edit",
            model,
            sizes=TINY_SIZES,
            steps=4,
            max_sequence_length=96,
            edit=True,
            description=DESCRIPTION + ", editing with up to three reference pictures",
        ),
        flux2_inpaint_workflow(
            "tiny-flux2-klein-inpaint",
            model,
            sizes=TINY_SIZES,
            steps=4,
            max_sequence_length=96,
            description=DESCRIPTION + ", inpainting",
        ),
    ]


def flux2_inpaint_workflow(
    name: str,
    model: str,
    *,
    sizes: list[str],
    steps: int = 50,
    max_sequence_length: int = 512,
    description: str = "",
) -> WorkflowSpec:
    """A Flux.2 Klein inpainting workflow on the ``Flux2KleinPipeline`` folder ``model``, taking
    :func:`~libs.models.common.edit_params` at ``Flux2KleinInpaintPipeline.__call__``'s defaults
    (``strength`` 0.8, ``guidance_scale`` 8.0)."""
    width, height = (int(x) for x in sizes[0].split("x"))
    text = Flux2TextEncoder(model, id="text")
    prepare = Flux2InpaintLatents(model, id="prepare")
    transformer = Flux2Transformer(model, id="transformer")
    scheduler = Flux2SchedulerStep(model, id="scheduler")
    blend = Flux2InpaintBlend(model, id="blend")
    vae = Flux2VaeDecode(model, id="vae")
    params = flux2_params(
        width=width, height=height, steps=steps, max_sequence_length=max_sequence_length, guidance_scale=8.0
    )
    params.update(edit_params(strength=0.8, inpaint=True))
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        text()  # prompt, guidance_scale, max_sequence_length
        init = prepare()  # image, mask, seed, height, width, num_inference_steps, strength

        def denoise(step: Value, latents: Value) -> Value:
            # prompt_embeds, text_ids, latent_ids, image_latents, image_latent_ids, timesteps by name
            noise_pred = transformer(latents=latents)
            latents = scheduler(noise_pred=noise_pred, latents=latents)
            return blend(latents=latents)  # image_latents, noise, init_mask: the preparation's

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
