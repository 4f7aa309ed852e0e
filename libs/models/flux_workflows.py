"""Flux workflows, composed from the ``flux.*`` ModelFns the way users compose theirs (the paper, §4,
Fig. 7).

``tiny-flux``: CLIP and T5 text encoders (two parallel nodes), latent preparation, the Flux
transformer once per denoising step followed by the flow-match Euler step, then VAE decode. Its
components are random-weight models built from configs (:func:`libs.models.tiny_flux.build`), so it
runs anywhere; the same composition serves a real Flux checkpoint by pointing ``model`` at it.

The Flux family (:func:`workflows`) varies that composition along three axes:

* **checkpoint**: dev (``tiny-flux``, guidance-distilled) or schnell (``tiny-flux-schnell``: no
  guidance embedding, no dynamic shifting, 4 steps; ``guidance_scale`` defaults to 0.0 and only
  reaches a ControlNet that embeds guidance).
* **ControlNet** (``-controlnet``): ``flux.control_encoder`` encodes the ``control_image`` parameter
  once and hands its generator state to ``flux.prepare_latents`` (the pipeline's draw order); every
  step runs ``flux.controlnet`` in parallel with ``flux.transformer``, which binds the residuals by
  name as callback inputs (fetched inside its forward). Parameters ``control_image`` (required) and
  ``control_scale`` (``controlnet_conditioning_scale``, default 1.0).
* **LoRA** (``-lora``): parameters ``lora`` (a registered adapter, ``""`` = none) and ``lora_scale``,
  bound by name to the transformer's optional inputs; one warm transformer serves any adapter.

The ControlNet and LoRA variants of each checkpoint come from
:func:`libs.models.common.variant_workflows`, with the parameters every family declares alike.

``tiny-flux-cfg-parallel`` is true CFG split for parallelism (the paper, Fig. 12-right): the prompt and
``negative_prompt`` are encoded by their own encoder nodes, each step runs two transformer nodes
(positive, negative; two executors can take them) and the light ``flux.true_cfg`` combine.

``tiny-flux-img2img`` and ``tiny-flux-inpaint`` (:func:`flux_edit_workflow`, on the dev checkpoint)
start from an ``image``: ``FluxImg2ImgPipeline`` and ``FluxInpaintPipeline``, whose loop runs only the
last steps of the schedule (``strength``); the inpainting one blends the kept region back after every
Euler step (:mod:`libs.models.flux_img2img`).

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

from libs.models.common import Variant, controlnet_params, edit_params, lora_params, variant_workflows
from libs.models.flux import (
    FlowMatchEulerStep,
    FluxClipEncoder,
    FluxPrepareLatents,
    FluxT5Encoder,
    FluxTransformer,
    FluxTrueCfg,
    FluxVaeDecode,
)
from libs.models.flux_controlnet import FluxControlImageEncoder, FluxControlNet
from libs.models.flux_img2img import FluxInpaintBlend, FluxInpaintLatents, FluxVaeEncode
from libs.models.stepcache import cache_params
from libs.workflow.compose import Value, Workflow
from libs.workflow.modelfn import ModelFn
from libs.workflow.spec import ParamSpec, WorkflowSpec

# Every Flux ModelFn (libs.models.flux and libs.models.flux_controlnet), for the catalog (entry
# points) and tests.
MODELFNS: list[type[ModelFn]] = [
    FluxClipEncoder,
    FluxT5Encoder,
    FluxControlImageEncoder,
    FluxPrepareLatents,
    FluxControlNet,
    FluxTransformer,
    FluxTrueCfg,
    FlowMatchEulerStep,
    FluxVaeDecode,
    FluxVaeEncode,
    FluxInpaintLatents,
    FluxInpaintBlend,
]

TINY_SIZES = ["128x128", "64x64", "256x256", "128x64", "64x128"]
DEV = "tiny Flux dev (guidance-distilled; random-weight CLIP+T5, DiT, VAE)"
SCHNELL = "tiny Flux schnell (no guidance embedding, 4 steps)"


def flux_params(
    *, width: int, height: int, steps: int, max_sequence_length: int, guidance_scale: float = 3.5
) -> dict[str, ParamSpec]:
    return {
        "prompt": ParamSpec(type="str", required=True, max_length=4000, description="what to draw"),
        "seed": ParamSpec(type="int", default=0, minimum=0, description="seed of the initial noise"),
        "width": ParamSpec(type="int", default=width, minimum=16, maximum=2048),
        "height": ParamSpec(type="int", default=height, minimum=16, maximum=2048),
        "num_inference_steps": ParamSpec(type="int", default=steps, minimum=1, maximum=100),
        "guidance_scale": ParamSpec(type="float", default=guidance_scale, minimum=0.0, maximum=30.0),
        "max_sequence_length": ParamSpec(type="int", default=max_sequence_length, minimum=1, maximum=512),
    }


def true_cfg_params() -> dict[str, ParamSpec]:
    return {
        "negative_prompt": ParamSpec(type="str", default="", max_length=4000, description="what not to draw"),
        # FluxPipeline applies true CFG when true_cfg_scale > 1 (and a negative prompt is given).
        "true_cfg_scale": ParamSpec(
            type="float", default=4.0, minimum=1.0, maximum=30.0, description="true CFG scale (> 1: on)"
        ),
    }


def flux_workflow(
    name: str,
    model: str,
    *,
    sizes: list[str],
    steps: int = 4,
    max_sequence_length: int = 64,
    description: str = "",
    guidance_scale: float = 3.5,
    controlnet: str | None = None,
    lora: bool = False,
    true_cfg: bool = False,
    cache: bool = True,
) -> WorkflowSpec:
    """A Flux text-to-image workflow on the checkpoint folder ``model``; ``controlnet`` names a
    ``FluxControlNetModel`` folder to condition on a control image; ``lora`` adds the LoRA
    parameters; ``true_cfg`` runs the negative prompt as a parallel transformer node per step;
    ``cache`` offers step caching per request (:mod:`libs.models.stepcache`; not with
    ``true_cfg``), its state carried from step to step next to the latents."""
    cache = cache and not true_cfg
    width, height = (int(x) for x in sizes[0].split("x"))
    clip = FluxClipEncoder(model, id="clip")
    t5 = FluxT5Encoder(model, id="t5")
    prepare = FluxPrepareLatents(model, id="prepare")
    transformer = FluxTransformer(model, id="transformer")
    euler = FlowMatchEulerStep(model, id="euler")
    vae = FluxVaeDecode(model, id="vae")
    params = flux_params(
        width=width,
        height=height,
        steps=steps,
        max_sequence_length=max_sequence_length,
        guidance_scale=guidance_scale,
    )
    if true_cfg:
        params.update(true_cfg_params())
    if controlnet:
        params.update(controlnet_params())
    if lora:
        params.update(lora_params())
    if cache:
        params.update(cache_params())
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        pooled = clip()  # prompt: bound by name to the parameter
        text = t5()  # prompt, max_sequence_length
        if true_cfg:
            negative = wf.param("negative_prompt")
            neg_pooled = FluxClipEncoder(model, id="clip_neg")(prompt=negative)
            neg_text = FluxT5Encoder(model, id="t5_neg")(prompt=negative)
        if controlnet:
            FluxControlImageEncoder(model, id="control")()  # control_image, height, width, seed
        # seed, height, width, num_inference_steps; with a ControlNet also the encoder's
        # generator_state, bound by name.
        init = prepare()
        controlnet_fn = FluxControlNet(controlnet, id="controlnet") if controlnet else None

        def denoise(
            step: Value, latents: Value, cache_state: Value | None = None
        ) -> Value | dict[str, Value]:
            if controlnet_fn is not None:
                controlnet_fn(latents=latents)  # its residuals are bound by name below
            if not true_cfg:
                # Every other input (embeddings, ids, timesteps, guidance, residuals, LoRA, the
                # cache parameters and the carried cache_state) by name.
                out = transformer(latents=latents)
                latents = euler(noise_pred=out.noise_pred, latents=latents)
                return {"latents": latents, "cache_state": out.cache_state} if cache else latents
            else:
                positive = transformer(
                    latents=latents,
                    prompt_embeds=text.prompt_embeds,
                    pooled_prompt_embeds=pooled,
                    text_ids=text.text_ids,
                ).noise_pred
                negative_pred = FluxTransformer(model, id="transformer_neg")(
                    latents=latents,
                    prompt_embeds=neg_text.prompt_embeds,
                    pooled_prompt_embeds=neg_pooled,
                    text_ids=neg_text.text_ids,
                ).noise_pred
                noise_pred = FluxTrueCfg(id="cfg")(noise_pred=positive, neg_noise_pred=negative_pred)
                return euler(noise_pred=noise_pred, latents=latents)

        carry = {"cache_state": init.cache_state} if cache else {}
        final = wf.loop("num_inference_steps", denoise, id="denoise", latents=init.latents, **carry)
        wf.output("image", vae(latents=final.latents if cache else final))
    return wf.spec()


def tiny_flux(model: str = "tiny-flux") -> WorkflowSpec:
    """The basic workflow of the dev checkpoint: the first of :func:`workflows`."""
    return flux_workflow("tiny-flux", model, sizes=TINY_SIZES, description=DEV)


def bench_flux(model: str = "bench-flux") -> WorkflowSpec:
    return flux_workflow(
        "bench-flux",
        model,
        sizes=["256x256"],
        description="Flux-style workflow with a 71M-parameter DiT, for benchmarks",
    )


def _checkpoint_variants(
    name: str, model: str, controlnet: str, description: str, guidance: float
) -> list[WorkflowSpec]:
    def compose(workflow: str, variant: Variant, text: str) -> WorkflowSpec:
        return flux_workflow(
            workflow,
            model,
            sizes=TINY_SIZES,
            guidance_scale=guidance,
            controlnet=controlnet if variant.controlnet else None,
            lora=variant.lora,
            description=text,
        )

    return variant_workflows(name, description, compose)


def workflows(
    dev: str = "tiny-flux", schnell: str = "tiny-flux-schnell", controlnet: str = "tiny-flux-controlnet"
) -> list[WorkflowSpec]:
    """The tiny Flux family: dev and schnell, each plain, with ControlNet, LoRA or both, and dev
    with parallel true CFG. Model names are folders under the executors' model root
    (:func:`libs.models.tiny_flux.build` builds them)."""
    return [
        *_checkpoint_variants("tiny-flux", dev, controlnet, DEV, guidance=3.5),
        *_checkpoint_variants("tiny-flux-schnell", schnell, controlnet, SCHNELL, guidance=0.0),
        flux_workflow(
            "tiny-flux-cfg-parallel",
            dev,
            sizes=TINY_SIZES,
            true_cfg=True,
            description="tiny Flux dev with true CFG: positive and negative transformer nodes per step",
        ),
        flux_edit_workflow(
            "tiny-flux-img2img", dev, inpaint=False, sizes=TINY_SIZES, description=DEV + ", img2img"
        ),
        flux_edit_workflow(
            "tiny-flux-inpaint", dev, inpaint=True, sizes=TINY_SIZES, description=DEV + ", inpainting"
        ),
    ]


def flux_edit_workflow(
    name: str,
    model: str,
    *,
    inpaint: bool,
    sizes: list[str],
    steps: int = 4,
    max_sequence_length: int = 64,
    description: str = "",
) -> WorkflowSpec:
    """A Flux image-to-image workflow on the checkpoint folder ``model`` (with ``inpaint``, the
    inpainting pipeline's), taking :func:`~libs.models.common.edit_params` at the pipelines'
    default strength, 0.6."""
    width, height = (int(x) for x in sizes[0].split("x"))
    clip = FluxClipEncoder(model, id="clip")
    t5 = FluxT5Encoder(model, id="t5")
    prepare: FluxVaeEncode = (
        FluxInpaintLatents(model, id="prepare") if inpaint else FluxVaeEncode(model, id="prepare")
    )
    transformer = FluxTransformer(model, id="transformer")
    euler = FlowMatchEulerStep(model, id="euler")
    blend = FluxInpaintBlend(model, id="blend")
    vae = FluxVaeDecode(model, id="vae")
    params = flux_params(width=width, height=height, steps=steps, max_sequence_length=max_sequence_length)
    params.update(edit_params(strength=0.6, inpaint=inpaint))
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        clip()
        t5()
        init = prepare()  # image (and mask), seed, height, width, num_inference_steps, strength

        def denoise(step: Value, latents: Value) -> Value:
            noise_pred = transformer(latents=latents).noise_pred
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
