"""Qwen-Image workflows, composed from the ``qwenimage.*`` ModelFns (the paper, §4, Fig. 7).

* ``tiny-qwenimage``: the Qwen2.5-VL text encoder (prompt and negative prompt), latent
  preparation, the transformer (both true-CFG passes and their combination in one node) then the
  scheduler step once per denoising step, then the 5-D VAE decode.
* ``tiny-qwenimage-controlnet``: ``QwenImageControlNetPipeline`` on its folder (every node runs on
  it): ``qwenimage.control_encode`` samples the ``control_image``'s latents once and hands its
  generator state to the latent preparation (the pipeline's draw order); every step runs
  ``qwenimage.controlnet`` in parallel with the transformer, which binds its block samples by name
  as a callback input. Parameters ``control_image`` and ``control_scale``
  (``controlnet_conditioning_scale``, default 1.0).
* ``tiny-qwenimage-lora`` / ``tiny-qwenimage-controlnet-lora``: the same with the ``lora`` and
  ``lora_scale`` parameters, which the transformer binds by name (the ControlNet runs without the
  adapter, as the pipeline's ``load_lora_weights`` loads into the transformer only).
* ``tiny-qwenimage-edit``: ``QwenImageEditPipeline``, an instruction edit of the ``image``
  parameter (the picture uploaded to ``/v1/images/edits``): the VL text encoder sees the prompt with
  the image, ``qwenimage.edit_image_encode`` VAE-encodes the image once, and the transformer binds
  its ``image_latents``/``image_shape`` by name and runs on the noise followed by them.
* ``tiny-qwenimage-edit-plus``: ``QwenImageEditPlusPipeline`` (the Qwen-Image-Edit-2509 layout, the
  same components; here on the edit folder): an instruction edit of ``image`` and the optional
  ``image_2`` and ``image_3`` (the further files of a ``/v1/images/edits`` upload), each picture
  seen by the VL encoder as "Picture i" and VAE-encoded, their tokens after the noise's.
* ``tiny-qwenimage-img2img`` and ``tiny-qwenimage-inpaint`` (:func:`qwenimage_img2img_workflow`,
  on the base folder): ``QwenImageImg2ImgPipeline`` and ``QwenImageInpaintPipeline``, the
  ``image`` (and ``mask``) parameters VAE-encoded and noised to the first step run; the loop runs
  only the last steps of the schedule (``strength``), and inpainting blends the kept region back
  after every Euler step (:mod:`libs.models.qwenimage_img2img`).

The generation variants come from :func:`libs.models.common.variant_workflows`. Defaults are
the pipelines' (``true_cfg_scale`` 4.0, ``max_sequence_length`` 512) except the tiny models' steps
and sizes; ``negative_prompt`` defaults to ``""``, which the pipelines take as a negative prompt, so
true CFG is on iff ``true_cfg_scale > 1``.

This module imports no torch: composing only records names and references.
"""

from __future__ import annotations

from libs.models.common import Variant, controlnet_params, edit_params, lora_params, variant_workflows
from libs.models.qwenimage import (
    QwenImagePrepareLatents,
    QwenImageSchedulerStep,
    QwenImageTextEncoder,
    QwenImageTransformer,
    QwenImageVaeDecode,
)
from libs.models.qwenimage_controlnet import QwenImageControlEncode, QwenImageControlNet
from libs.models.qwenimage_img2img import (
    EXTRA_PICTURES,
    QwenImageEditImageEncode,
    QwenImageEditPlusImageEncode,
    QwenImageEditPlusTextEncoder,
    QwenImageEditTextEncoder,
    QwenImageInpaintBlend,
    QwenImageInpaintLatents,
    QwenImageVaeEncode,
)
from libs.models.stepcache import cache_params
from libs.workflow.compose import Value, Workflow
from libs.workflow.modelfn import ModelFn
from libs.workflow.spec import ParamSpec, WorkflowSpec

# Every Qwen-Image ModelFn (libs.models.qwenimage, qwenimage_controlnet and qwenimage_img2img), for the
# catalog (entry points) and tests.
MODELFNS: list[type[ModelFn]] = [
    QwenImageTextEncoder,
    QwenImageEditTextEncoder,
    QwenImageEditImageEncode,
    QwenImagePrepareLatents,
    QwenImageControlEncode,
    QwenImageControlNet,
    QwenImageTransformer,
    QwenImageSchedulerStep,
    QwenImageVaeDecode,
    QwenImageVaeEncode,
    QwenImageInpaintLatents,
    QwenImageInpaintBlend,
    QwenImageEditPlusTextEncoder,
    QwenImageEditPlusImageEncode,
]

TINY_SIZES = ["64x64", "96x64", "64x96", "128x128"]
DESCRIPTION = "tiny Qwen-Image (random-weight Qwen2.5-VL encoder, MMDiT with true CFG, 3-D causal VAE)"
EDIT_DESCRIPTION = "tiny Qwen-Image-Edit: an instruction edit of the input image"
EDIT_PLUS_DESCRIPTION = "tiny Qwen-Image-Edit-Plus: an instruction edit of up to three input images"


def qwenimage_params(
    *, width: int, height: int, steps: int, max_sequence_length: int
) -> dict[str, ParamSpec]:
    """The parameters of the basic Qwen-Image workflow."""
    return {
        "prompt": ParamSpec(type="str", required=True, max_length=4000, description="what to draw"),
        "negative_prompt": ParamSpec(type="str", default="", max_length=4000, description="what not to draw"),
        "seed": ParamSpec(type="int", default=0, minimum=0, description="seed of the initial noise"),
        "width": ParamSpec(type="int", default=width, minimum=16, maximum=4096),
        "height": ParamSpec(type="int", default=height, minimum=16, maximum=4096),
        "num_inference_steps": ParamSpec(type="int", default=steps, minimum=1, maximum=100),
        "true_cfg_scale": ParamSpec(
            type="float",
            default=4.0,
            minimum=0.0,
            maximum=30.0,
            description="true classifier-free guidance (two transformer passes) iff > 1",
        ),
        "max_sequence_length": ParamSpec(type="int", default=max_sequence_length, minimum=1, maximum=1024),
    }


def qwenimage_workflow(
    name: str,
    model: str,
    *,
    sizes: list[str],
    steps: int = 50,
    max_sequence_length: int = 512,
    controlnet: bool = False,
    lora: bool = False,
    edit: bool = False,
    plus: bool = False,
    cache: bool = True,
    description: str = "",
) -> WorkflowSpec:
    """``model``: a Qwen-Image pipeline folder (a ``QwenImageControlNetPipeline`` one for
    ``controlnet``, a ``QwenImageEditPipeline`` one for ``edit``); ``plus`` (with ``edit``): the
    ``QwenImageEditPlusPipeline`` edit of ``image`` and the optional ``image_2``, ``image_3``."""
    if plus and not edit:
        raise ValueError("plus is an edit pipeline: pass edit=True")
    if controlnet and edit:
        raise ValueError("the Qwen-Image edit pipeline has no ControlNet variant")
    width, height = (int(x) for x in sizes[0].split("x"))
    params = qwenimage_params(
        width=width, height=height, steps=steps, max_sequence_length=max_sequence_length
    )
    if edit:
        params["image"] = ParamSpec(type="image", required=True, description="the picture to edit, RGB")
    if plus:
        for i, extra in enumerate(EXTRA_PICTURES, start=2):
            params[extra] = ParamSpec(type="image", description=f"picture {i} of the edit (optional), RGB")
    if controlnet:
        params.update(controlnet_params())
    if lora:
        params.update(lora_params())
    if cache:
        params.update(cache_params())
    if plus:
        text, encode = QwenImageEditPlusTextEncoder(model, id="text"), QwenImageEditPlusImageEncode
    else:
        text = (QwenImageEditTextEncoder if edit else QwenImageTextEncoder)(model, id="text")
        encode = QwenImageEditImageEncode
    prepare = QwenImagePrepareLatents(model, id="prepare")
    transformer = QwenImageTransformer(model, id="transformer")
    scheduler = QwenImageSchedulerStep(model, id="scheduler")
    vae = QwenImageVaeDecode(model, id="vae")
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        text()  # prompt, negative_prompt, true_cfg_scale, max_sequence_length (and the pictures)
        if edit:
            encode(model, id="image_encode")()  # image (and image_2, image_3)
        if controlnet:
            QwenImageControlEncode(model, id="control")()  # control_image, seed, height, width
        init = prepare()  # seed, height, width, num_inference_steps (and generator_state)

        def denoise(
            step: Value, latents: Value, cache_state: Value | None = None
        ) -> Value | dict[str, Value]:
            if controlnet:
                QwenImageControlNet(model, id="controlnet")(latents=latents)
            # embeddings, image_latents/image_shape (edit), the ControlNet's block samples, lora,
            # lora_scale, the cache parameters and the carried cache_state: bound by name
            out = transformer(latents=latents)
            latents = scheduler(noise_pred=out.noise_pred, latents=latents)
            return {"latents": latents, "cache_state": out.cache_state} if cache else latents

        carry = {"cache_state": init.cache_state} if cache else {}
        final = wf.loop("num_inference_steps", denoise, id="denoise", latents=init.latents, **carry)
        wf.output("image", vae(latents=final.latents if cache else final))
    return wf.spec()


def qwenimage_img2img_workflow(
    name: str,
    model: str,
    *,
    inpaint: bool,
    sizes: list[str],
    steps: int = 50,
    max_sequence_length: int = 512,
    description: str = "",
) -> WorkflowSpec:
    """An image-to-image workflow on the ``QwenImagePipeline`` folder ``model`` (with ``inpaint``,
    the inpainting pipeline's), taking :func:`~libs.models.common.edit_params` at both pipelines'
    default strength, 0.6."""
    width, height = (int(x) for x in sizes[0].split("x"))
    params = qwenimage_params(
        width=width, height=height, steps=steps, max_sequence_length=max_sequence_length
    )
    params.update(edit_params(strength=0.6, inpaint=inpaint))
    text = QwenImageTextEncoder(model, id="text")
    prepare: QwenImageVaeEncode = (
        QwenImageInpaintLatents(model, id="prepare") if inpaint else QwenImageVaeEncode(model, id="prepare")
    )
    transformer = QwenImageTransformer(model, id="transformer")
    scheduler = QwenImageSchedulerStep(model, id="scheduler")
    blend = QwenImageInpaintBlend(model, id="blend")
    vae = QwenImageVaeDecode(model, id="vae")
    with Workflow(name, params=params, sizes=sizes, description=description) as wf:
        text()  # prompt, negative_prompt, true_cfg_scale, max_sequence_length
        init = prepare()  # image (and mask), seed, height, width, num_inference_steps, strength

        def denoise(step: Value, latents: Value) -> Value:
            noise_pred = transformer(latents=latents).noise_pred  # the embeddings, bound by name
            latents = scheduler(noise_pred=noise_pred, latents=latents)
            # init_latents, noise, init_mask: the preparation's, bound by name
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


def workflows(
    model: str = "tiny-qwenimage",
    edit_model: str = "tiny-qwenimage-edit",
    controlnet_model: str = "tiny-qwenimage-controlnet",
) -> list[WorkflowSpec]:
    """The tiny Qwen-Image family: plain, with ControlNet, LoRA or both, the instruction edit,
    img2img and inpainting. ``model`` is a ``QwenImagePipeline`` folder, ``edit_model`` a
    ``QwenImageEditPipeline`` one and ``controlnet_model`` a ``QwenImageControlNetPipeline`` one;
    :func:`libs.models.tiny_qwenimage.build` builds all three."""

    def tiny(
        name: str,
        folder: str,
        description: str,
        *,
        controlnet: bool = False,
        lora: bool = False,
        edit: bool = False,
        plus: bool = False,
    ) -> WorkflowSpec:
        return qwenimage_workflow(
            name,
            folder,
            sizes=TINY_SIZES,
            steps=4,
            max_sequence_length=64,
            controlnet=controlnet,
            lora=lora,
            edit=edit,
            plus=plus,
            description=description,
        )

    def variant(name: str, v: Variant, description: str) -> WorkflowSpec:
        folder = controlnet_model if v.controlnet else model
        return tiny(name, folder, description, controlnet=v.controlnet, lora=v.lora)

    return [
        *variant_workflows("tiny-qwenimage", DESCRIPTION, variant),
        tiny("tiny-qwenimage-edit", edit_model, EDIT_DESCRIPTION, edit=True),
        tiny("tiny-qwenimage-edit-plus", edit_model, EDIT_PLUS_DESCRIPTION, edit=True, plus=True),
        *(
            qwenimage_img2img_workflow(
                name,
                model,
                inpaint=inpaint,
                sizes=TINY_SIZES,
                steps=4,
                max_sequence_length=64,
                description=f"{DESCRIPTION}, {kind}",
            )
            for name, inpaint, kind in (
                ("tiny-qwenimage-img2img", False, "img2img"),
                ("tiny-qwenimage-inpaint", True, "inpainting"),
            )
        ),
    ]
