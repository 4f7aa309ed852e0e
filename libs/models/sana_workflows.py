"""Sana workflows, composed from the ``sana.*`` ModelFns (the paper, §4, Fig. 7).

* ``tiny-sana``: Gemma2 text encoder (prompt and negative prompt), latent preparation, the Sana
  transformer (with classifier-free guidance) then the scheduler step once per denoising step,
  then the DC-AE decode.
* ``tiny-sana-controlnet``: the same plus the control image encoded once and the ControlNet once
  per step, in parallel with the transformer, which fetches the ControlNet's block samples inside
  its forward (callback input).
* ``tiny-sana-lora`` / ``tiny-sana-controlnet-lora``: the same with the ``lora`` and
  ``lora_scale`` parameters, which the transformer binds by name.

The four variants come from :func:`libs.models.common.variant_workflows`.

The loop carries ``latents`` and ``solver_history`` (empty for flow-match Euler; a multistep
DPM-Solver's previous outputs otherwise), so the same composition serves a real Sana checkpoint,
whose scheduler is ``DPMSolverMultistepScheduler``, by pointing ``model`` at it.

Defaults are ``SanaPipeline.__call__``'s except where the tiny model needs its own (steps, max
sequence length); ``sizes`` are entries of the 512-px aspect-ratio bin table (the tiny
transformer's ``sample_size`` is 16), so resolution binning leaves them as they are.

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

from libs.models.common import Variant, controlnet_params, lora_params, variant_workflows
from libs.models.sana import (
    SanaPrepareLatents,
    SanaSchedulerStep,
    SanaTextEncoder,
    SanaTransformer,
    SanaVaeDecode,
)
from libs.models.sana_controlnet import SanaControlEncode, SanaControlNet
from libs.workflow.compose import Value, Workflow
from libs.workflow.modelfn import ModelFn
from libs.workflow.spec import ParamSpec, WorkflowSpec

# Every Sana ModelFn (libs.models.sana and libs.models.sana_controlnet), for the catalog (entry
# points) and tests.
MODELFNS: list[type[ModelFn]] = [
    SanaTextEncoder,
    SanaPrepareLatents,
    SanaControlEncode,
    SanaControlNet,
    SanaTransformer,
    SanaSchedulerStep,
    SanaVaeDecode,
]

TINY_SIZES = ["512x512", "672x384", "384x672", "576x448"]
DESCRIPTION = "tiny Sana (random-weight Gemma2, linear DiT with CFG, DC-AE)"


def sana_params(*, width: int, height: int, steps: int, max_sequence_length: int) -> dict[str, ParamSpec]:
    """The parameters of the basic Sana workflow (:func:`sana_workflow` adds a variant's)."""
    return {
        "prompt": ParamSpec(type="str", required=True, max_length=4000, description="what to draw"),
        "negative_prompt": ParamSpec(type="str", default="", max_length=4000, description="what not to draw"),
        "seed": ParamSpec(type="int", default=0, minimum=0, description="seed of the initial noise"),
        "width": ParamSpec(type="int", default=width, minimum=32, maximum=4096),
        "height": ParamSpec(type="int", default=height, minimum=32, maximum=4096),
        "num_inference_steps": ParamSpec(type="int", default=steps, minimum=1, maximum=100),
        "guidance_scale": ParamSpec(
            type="float",
            default=4.5,
            minimum=0.0,
            maximum=30.0,
            description="classifier-free guidance iff > 1",
        ),
        "max_sequence_length": ParamSpec(type="int", default=max_sequence_length, minimum=1, maximum=1024),
        "complex_human_instruction": ParamSpec(
            type="bool",
            default=True,
            description="prefix the prompt with Sana's prompt-enhancing instruction",
        ),
        "use_resolution_binning": ParamSpec(
            type="bool",
            default=True,
            description="generate at the nearest aspect-ratio bin, then resize back",
        ),
    }


def sana_workflow(
    name: str,
    model: str,
    *,
    sizes: list[str],
    steps: int = 20,
    max_sequence_length: int = 300,
    controlnet: bool = False,
    controlnet_model: str | None = None,
    lora: bool = False,
    description: str = "",
) -> WorkflowSpec:
    """``model``: a Sana pipeline folder (a ``SanaControlNetPipeline`` one for ``controlnet``
    unless ``controlnet_model`` names a ControlNet folder of its own)."""
    width, height = (int(x) for x in sizes[0].split("x"))
    text = SanaTextEncoder(model, id="text")
    prepare = SanaPrepareLatents(model, id="prepare")
    transformer = SanaTransformer(model, id="transformer")
    scheduler = SanaSchedulerStep(model, id="scheduler")
    vae = SanaVaeDecode(model, id="vae")
    params = sana_params(width=width, height=height, steps=steps, max_sequence_length=max_sequence_length)
    if controlnet:
        params.update(controlnet_params())
    if lora:
        params.update(lora_params())
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        text()  # prompt, negative_prompt, guidance_scale, max_sequence_length, complex_human_instruction
        init = prepare()  # seed, height, width, num_inference_steps, use_resolution_binning
        if controlnet:
            SanaControlEncode(model, id="control")()  # control_image, height, width, ...

        def denoise(step: Value, latents: Value, solver_history: Value) -> object:
            if controlnet:
                SanaControlNet(controlnet_model or model, id="controlnet")(latents=latents)
            # controlnet_block_samples (if any), lora, lora_scale and the rest: bound by name
            noise_pred = transformer(latents=latents)
            return scheduler(noise_pred=noise_pred, latents=latents, solver_history=solver_history)

        final = wf.loop(
            "num_inference_steps",
            denoise,
            id="denoise",
            latents=init.latents,
            solver_history=init.solver_history,
        )
        wf.output("image", vae(latents=final.latents))
    return wf.spec()


def workflows(model: str = "tiny-sana", controlnet_model: str = "tiny-sana-controlnet") -> list[WorkflowSpec]:
    """The tiny Sana family: plain, with ControlNet, LoRA or both. ``model`` is a ``SanaPipeline``
    folder, ``controlnet_model`` a ``SanaControlNetPipeline`` one (the ControlNet variants run all
    their nodes on it); :func:`libs.models.tiny_sana.build` builds both."""

    def compose(name: str, variant: Variant, description: str) -> WorkflowSpec:
        return sana_workflow(
            name,
            controlnet_model if variant.controlnet else model,
            sizes=TINY_SIZES,
            steps=4,
            max_sequence_length=32,
            controlnet=variant.controlnet,
            lora=variant.lora,
            description=description,
        )

    return variant_workflows("tiny-sana", DESCRIPTION, compose)
