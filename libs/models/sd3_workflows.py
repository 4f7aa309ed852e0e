"""Stable Diffusion 3 workflows, composed from the ``sd3.*`` ModelFns (paper Fig. 7).

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
``force_zeros_for_pooled_projection``: ``sd3.controlnet`` refuses a value its config contradicts).

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

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
]

TINY_SIZES = ["128x128", "64x64", "256x256", "128x64", "64x128"]


def sd3_params(
    *,
    width: int,
    height: int,
    steps: int,
    max_sequence_length: int,
    guidance_scale: float = 7.0,
    lora: bool = False,
    controlnet: bool = False,
) -> dict[str, ParamSpec]:
    """The parameters of an SD3 workflow; defaults follow ``StableDiffusion3Pipeline.__call__``'s
    (guidance 7.0, ``controlnet_conditioning_scale`` 1.0) except size, steps and sequence length."""
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
    if controlnet:
        params["control_image"] = ParamSpec(
            type="image", required=True, description="the ControlNet's condition"
        )
        params["control_scale"] = ParamSpec(
            type="float", default=1.0, minimum=0.0, maximum=2.0, description="controlnet_conditioning_scale"
        )
    if lora:
        params["lora"] = ParamSpec(type="lora", default="", description="a registered LoRA ('' = none)")
        params["lora_scale"] = ParamSpec(type="float", default=1.0, minimum=-4.0, maximum=4.0)
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
    params = sd3_params(
        width=width,
        height=height,
        steps=steps,
        max_sequence_length=max_sequence_length,
        lora=lora,
        controlnet=controlnet is not None,
    )
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


def tiny_sd3(model: str = "tiny-sd3") -> WorkflowSpec:
    return sd3_workflow(
        "tiny-sd3",
        model,
        sizes=TINY_SIZES,
        description="SD3-style workflow with random-weight tiny components (CLIP-L/G + T5, MMDiT, VAE)",
    )


def tiny_sd3_controlnet(model: str = "tiny-sd3", controlnet: str = "tiny-sd3-controlnet") -> WorkflowSpec:
    return sd3_workflow(
        "tiny-sd3-controlnet",
        model,
        sizes=TINY_SIZES,
        controlnet=controlnet,
        description="tiny-sd3 with an SD3 ControlNet beside the transformer every step",
    )


def tiny_sd3_lora(model: str = "tiny-sd3") -> WorkflowSpec:
    return sd3_workflow(
        "tiny-sd3-lora",
        model,
        sizes=TINY_SIZES,
        lora=True,
        description="tiny-sd3 with a per-request transformer LoRA",
    )


def tiny_sd3_controlnet_lora(
    model: str = "tiny-sd3", controlnet: str = "tiny-sd3-controlnet"
) -> WorkflowSpec:
    return sd3_workflow(
        "tiny-sd3-controlnet-lora",
        model,
        sizes=TINY_SIZES,
        controlnet=controlnet,
        lora=True,
        description="tiny-sd3 with an SD3 ControlNet and a per-request transformer LoRA",
    )


BUILTIN = {
    "tiny-sd3": tiny_sd3,
    "tiny-sd3-controlnet": tiny_sd3_controlnet,
    "tiny-sd3-lora": tiny_sd3_lora,
    "tiny-sd3-controlnet-lora": tiny_sd3_controlnet_lora,
}


def workflows() -> list[WorkflowSpec]:
    """The built-in SD3 workflows, composed on the tiny models' names."""
    return [make() for make in BUILTIN.values()]
