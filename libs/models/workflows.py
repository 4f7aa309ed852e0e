"""Built-in workflows, composed from ModelFns the way users compose theirs (paper Fig. 7).

``tiny-flux``: CLIP and T5 text encoders (two parallel nodes), latent preparation, the Flux
transformer once per denoising step followed by the flow-match Euler step, then VAE decode. Its
components are random-weight models built from configs (``python -m libs.models.build``), so it
runs anywhere; the same composition serves a real Flux checkpoint by pointing ``model`` at it.

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

from libs.models.flux import (
    FlowMatchEulerStep,
    FluxClipEncoder,
    FluxPrepareLatents,
    FluxT5Encoder,
    FluxTransformer,
    FluxVaeDecode,
)
from libs.workflow.compose import Value, Workflow
from libs.workflow.spec import ParamSpec, WorkflowSpec


def flux_params(*, width: int, height: int, steps: int, max_sequence_length: int) -> dict[str, ParamSpec]:
    return {
        "prompt": ParamSpec(type="str", required=True, max_length=4000, description="what to draw"),
        "seed": ParamSpec(type="int", default=0, minimum=0, description="seed of the initial noise"),
        "width": ParamSpec(type="int", default=width, minimum=16, maximum=2048),
        "height": ParamSpec(type="int", default=height, minimum=16, maximum=2048),
        "num_inference_steps": ParamSpec(type="int", default=steps, minimum=1, maximum=100),
        "guidance_scale": ParamSpec(type="float", default=3.5, minimum=0.0, maximum=30.0),
        "max_sequence_length": ParamSpec(type="int", default=max_sequence_length, minimum=1, maximum=512),
    }


def flux_workflow(
    name: str,
    model: str,
    *,
    sizes: list[str],
    steps: int = 4,
    max_sequence_length: int = 64,
    description: str = "",
) -> WorkflowSpec:
    width, height = (int(x) for x in sizes[0].split("x"))
    clip = FluxClipEncoder(model, id="clip")
    t5 = FluxT5Encoder(model, id="t5")
    prepare = FluxPrepareLatents(model, id="prepare")
    transformer = FluxTransformer(model, id="transformer")
    euler = FlowMatchEulerStep(model, id="euler")
    vae = FluxVaeDecode(model, id="vae")
    params = flux_params(width=width, height=height, steps=steps, max_sequence_length=max_sequence_length)
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        clip()  # prompt: bound by name to the parameter
        t5()  # prompt, max_sequence_length
        init = prepare()  # seed, height, width, num_inference_steps

        def denoise(step: Value, latents: Value) -> Value:
            # Every other input (embeddings, ids, timesteps, guidance) is bound by name.
            noise_pred = transformer(latents=latents)
            return euler(noise_pred=noise_pred, latents=latents)

        latents = wf.loop("num_inference_steps", denoise, id="denoise", latents=init.latents)
        wf.output("image", vae(latents=latents))
    return wf.spec()


def tiny_flux(model: str = "tiny-flux") -> WorkflowSpec:
    return flux_workflow(
        "tiny-flux",
        model,
        sizes=["128x128", "64x64", "256x256", "128x64", "64x128"],
        description="Flux-style workflow with random-weight tiny components (CLIP+T5, DiT, VAE)",
    )


def bench_flux(model: str = "bench-flux") -> WorkflowSpec:
    return flux_workflow(
        "bench-flux",
        model,
        sizes=["256x256"],
        description="Flux-style workflow with a 71M-parameter DiT, for benchmarks",
    )


BUILTIN = {"tiny-flux": tiny_flux, "bench-flux": bench_flux}
