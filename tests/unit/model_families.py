"""What the model-family tests share: one harness per family (its tiny models, requests, the node-by-node
run and the monolithic diffusers pipeline it must equal), built once per test session.

A :class:`Harness` knows how to build its family under a temporary model root (cached for the whole
session, so the family's own test file and ``test_each_family.py`` share one build and one warm
runner), what a request to each of its workflows looks like, how to run a workflow node by node through
:class:`~libs.workflow.local.LocalRunner` and how to get the same request's image from the monolithic
pipeline. Thread counts change the bits, so every test module pins torch to one thread (for pipelines
and nodes alike).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from libs.models import families
from libs.workflow.local import LocalRunner
from libs.workflow.modelfn import ModelFn
from libs.workflow.spec import WorkflowSpec

PROMPT = "A photo of a Cat holding a sign that says 'hello world', 4k!"
NEGATIVE = "blurry, low quality"
CONTROL = "control"  # the name requests give the control image; the harness maps it to the picture
STYLE = "style"  # the name requests give the family's LoRA; the harness maps it to the file
INIT, MASK = "init", "mask"  # the names requests give an img2img/inpaint workflow's picture and mask
SECOND, THIRD = "second", "third"  # the names requests give an edit's further pictures
REF_2, REF_3 = "ref2", "ref3"  # the names requests give an edit's second and third reference pictures


@dataclass(frozen=True, eq=False)
class Result:
    """A workflow's (or pipeline's) image, uint8 [H, W, 3], and, where the harness records them, the
    final latents before the VAE (compared too: uint8 rounding can hide a difference of a few ulps)."""

    image: np.ndarray
    latents: torch.Tensor | None = None

    def same(self, other: Result) -> bool:
        if self.latents is not None and other.latents is not None:
            if not torch.equal(self.latents, other.latents):
                return False
        return np.array_equal(self.image, other.image)


@dataclass(frozen=True)
class MidForward:
    """Where a family's denoiser fetches its ControlNet's outputs: the callback inputs, forward hooks
    on submodules of its model (``component``; dotted paths -> event label) and the events one step
    must log, from ``execute`` to ``done``."""

    workflow: str
    component: str
    callbacks: tuple[str, ...]
    hooks: dict[str, str]
    per_step: list[str]
    changes: dict[str, Any] = field(default_factory=dict)


class Harness:
    family: str  # libs.models.families key
    base: str  # the basic workflow's name, which is also its model folder's
    denoiser: str  # fn_name of the node that takes the LoRA and the ControlNet's outputs
    step_rejects: dict[str, Any] = {}  # extra prepare_latents inputs for the scheduler-step check
    mid_forward: MidForward | None  # None: the family has no ControlNet workflow
    cases: list[Any] = []  # (workflow, changes, id) of the bitwise tests

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths = self.build(root)
        fam = families.FAMILIES[self.family]
        self.workflows_module = fam.module("workflows")
        self.specs: dict[str, WorkflowSpec] = {s.name: s for s in self.workflows_module.workflows()}
        self.loras = {STYLE: str(self.paths[fam.lora])}
        self.runner = LocalRunner(root, classes=self.classes())

    # -- what each family defines ----------------------------------------------------------------
    def build(self, root: Path) -> dict[str, Path]:
        return families.FAMILIES[self.family].module("builder").build(root)

    def base_request(self, workflow: str) -> dict[str, Any]:
        raise NotImplementedError

    def control_image(self) -> Image.Image:
        raise NotImplementedError

    def reference(self, workflow: str, params: dict[str, Any]) -> Result:
        """The monolithic pipeline's result for the request ``params`` to ``workflow``."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------
    def classes(self, **replace: type[ModelFn]) -> dict[str, type[ModelFn]]:
        return {**{cls.fn_name: cls for cls in self.workflows_module.MODELFNS}, **replace}

    def request(self, workflow: str, **changes: Any) -> dict[str, Any]:
        """A request to ``workflow`` with every parameter it declares resolved (its defaults, the
        family's base request, then ``changes``): what the pipeline must be called with."""
        spec = self.specs[workflow]
        params = {name: p.default for name, p in spec.params.items() if p.default is not None}
        params.update({k: v for k, v in self.base_request(workflow).items() if k in spec.params})
        if "control_image" in spec.params:
            params["control_image"] = CONTROL
        if "image" in spec.params:
            params["image"] = INIT
        if "mask" in spec.params:
            params["mask"] = MASK
        if "lora" in spec.params:
            params["lora"] = STYLE
        params.update(changes)
        return params

    def images(self, workflow: str, params: dict[str, Any]) -> dict[str, Any]:
        """The pictures a request to ``workflow`` names that the family provides (every run gets
        the control image; a family with an edit workflow adds its input picture)."""
        return {CONTROL: self.control_image()}

    def run(self, runner: LocalRunner, workflow: str, params: dict[str, Any], **images: Any) -> Result:
        images = {**self.images(workflow, params), **images}
        out = runner.run(self.specs[workflow], params, images=images, loras=self.loras)
        image = out["image"]
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
        return Result(image.numpy())


# -- Flux ----------------------------------------------------------------------------------------------


class FluxPipes:
    """Monolithic Flux pipelines over the built folders, one per (checkpoint, ControlNet?, LoRA?)."""

    def __init__(self, models: dict[str, Path]) -> None:
        self.models = models
        self._pipes: dict[tuple[str, bool, bool], Any] = {}

    def get(self, model: str, controlnet: bool, lora: bool) -> Any:
        key = (model, controlnet, lora)
        if key not in self._pipes:
            from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxPipeline

            pipe = FluxPipeline.from_pretrained(self.models[model])
            if controlnet:
                cn = FluxControlNetModel.from_pretrained(self.models["tiny-flux-controlnet"])
                parts = {
                    k: v
                    for k, v in pipe.components.items()
                    if k not in ("image_encoder", "feature_extractor")
                }
                pipe = FluxControlNetPipeline(**parts, controlnet=cn)
            if lora:
                pipe.load_lora_weights(str(self.models["tiny-flux-style"]), adapter_name=STYLE)
            pipe.set_progress_bar_config(disable=True)
            self._pipes[key] = pipe
        return self._pipes[key]

    def image(
        self,
        model: str,
        params: dict[str, Any],
        *,
        control_image: Image.Image | None = None,
        lora_scale: float | None = None,
        **extra: Any,
    ) -> Result:
        """The pipeline's image and final latents for a workflow's resolved parameters."""
        pipe = self.get(model, control_image is not None, lora_scale is not None)
        if lora_scale is not None:
            pipe.set_adapters([STYLE], [lora_scale])  # what LoraSwitch does on the transformer
        kwargs = dict(extra)
        if control_image is not None:
            kwargs.update(control_image=control_image, controlnet_conditioning_scale=params["control_scale"])
        outputs = [
            pipe(
                params["prompt"],
                height=params["height"],
                width=params["width"],
                num_inference_steps=params["num_inference_steps"],
                guidance_scale=params["guidance_scale"],
                generator=torch.Generator().manual_seed(params["seed"]),
                max_sequence_length=params["max_sequence_length"],
                output_type=output_type,
                **kwargs,
            ).images
            for output_type in ("pil", "latent")
        ]
        return Result(np.array(outputs[0][0]), outputs[1])


class Flux(Harness):
    family, base, denoiser = "flux", "tiny-flux", "flux.transformer"
    cases = [(name, {}, name) for name in ("tiny-flux", "tiny-flux-schnell")]
    cases += [
        (f"{b}{s}", {}, f"{b}{s}")
        for b in ("tiny-flux", "tiny-flux-schnell")
        for s in ("-controlnet", "-lora", "-controlnet-lora")
    ]
    mid_forward = MidForward(
        workflow="tiny-flux-controlnet",
        component="transformer",
        callbacks=("controlnet_block_samples", "controlnet_single_block_samples"),
        hooks={"transformer_blocks.0": "double block 0", "single_transformer_blocks.0": "single block 0"},
        per_step=[
            "execute",
            "double block 0",
            "fetch controlnet_block_samples",
            "single block 0",
            "fetch controlnet_single_block_samples",
            "done",
        ],
    )

    def __init__(self, root: Path) -> None:
        self.decoded: list[torch.Tensor] = []  # the latents every flux.vae_decode received
        super().__init__(root)
        self.pipes = FluxPipes(self.paths)

    def classes(self, **replace: type[ModelFn]) -> dict[str, type[ModelFn]]:
        from libs.models.flux import FluxVaeDecode

        decoded = self.decoded

        class RecordingVaeDecode(FluxVaeDecode):
            def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
                decoded.append(inputs["latents"])
                return super().execute(components, **inputs)

        return super().classes(**{"flux.vae_decode": RecordingVaeDecode, **replace})

    def base_request(self, workflow: str) -> dict[str, Any]:
        """64x96 (not square), seed 11; dev with 3 steps, schnell with its defaults."""
        params: dict[str, Any] = dict(prompt=PROMPT, height=64, width=96, seed=11, max_sequence_length=32)
        if "schnell" not in workflow:
            params.update(num_inference_steps=3, guidance_scale=3.5)
        return {**params, "control_scale": 0.7, "lora_scale": 0.8}

    def control_image(self) -> Image.Image:
        # Not the output size: the pipeline (and flux.control_encoder) resize it.
        pixels = np.random.default_rng(7).integers(0, 256, (80, 72, 3), dtype=np.uint8)
        return Image.fromarray(pixels, "RGB")

    def run(self, runner: LocalRunner, workflow: str, params: dict[str, Any], **images: Any) -> Result:
        image = super().run(runner, workflow, params, **images).image
        return Result(image, self.decoded[-1])

    def reference(self, workflow: str, params: dict[str, Any], **extra: Any) -> Result:
        model = "tiny-flux-schnell" if "schnell" in workflow else "tiny-flux"
        return self.pipes.image(
            model,
            params,
            control_image=self.control_image() if "control_image" in params else None,
            lora_scale=params["lora_scale"] if params.get("lora") else None,
            **extra,
        )


# -- Stable Diffusion 1.5 ------------------------------------------------------------------------------

SD_LORAS = {STYLE: "loras/tiny-sd15-style.safetensors", "other": "loras/tiny-sd15-other.safetensors"}


def sd_pipeline_image(
    root: Path,
    params: dict[str, Any],
    *,
    control_image: Image.Image | None = None,
    lora: str | None = None,
    pipe: Any = None,
) -> np.ndarray:
    """The monolithic SD1.5 pipeline's image for the same request, on a freshly loaded pipeline (or
    ``pipe``, one of :meth:`Sd.pipeline`'s, whose adapters are loaded already)."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline

    kwargs: dict[str, Any] = dict(
        negative_prompt=params.get("negative_prompt", ""),
        height=params["height"],
        width=params["width"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params["guidance_scale"],
        generator=torch.Generator().manual_seed(params["seed"]),
    )
    if control_image is not None:
        kwargs.update(image=control_image, controlnet_conditioning_scale=params.get("control_scale", 1.0))
    if pipe is None:
        if control_image is None:
            pipe = StableDiffusionPipeline.from_pretrained(root / "tiny-sd15")
        else:
            controlnet = ControlNetModel.from_pretrained(root / "tiny-sd15-controlnet")
            pipe = StableDiffusionControlNetPipeline.from_pretrained(
                root / "tiny-sd15", controlnet=controlnet
            )
        pipe.set_progress_bar_config(disable=True)
        if lora:
            pipe.load_lora_weights(str(root / SD_LORAS[lora]), adapter_name=lora)
    if lora:
        pipe.set_adapters([lora], [params.get("lora_scale", 1.0)])
    return np.array(pipe(params["prompt"], **kwargs).images[0])


class Sd(Harness):
    family, base, denoiser = "sd", "tiny-sd15", "sd.unet"
    cases = [
        ("tiny-sd15", {}, "base"),
        ("tiny-sd15", dict(width=128, seed=0, guidance_scale=1.0, num_inference_steps=2), "base-no-cfg"),
        ("tiny-sd15-controlnet", dict(control_scale=0.7), "controlnet"),
        ("tiny-sd15-controlnet", dict(height=128, guidance_scale=1.0, seed=3), "controlnet-no-cfg"),
        ("tiny-sd15-lora", dict(lora_scale=0.8), "lora"),
        ("tiny-sd15-controlnet-lora", dict(lora_scale=1.3, num_inference_steps=4), "controlnet-lora"),
    ]
    mid_forward = MidForward(
        workflow="tiny-sd15-controlnet",
        component="unet",
        callbacks=("down_block_res_samples", "mid_block_res_sample"),
        hooks={"down_blocks.0": "down_blocks[0] ran", "mid_block": "mid_block ran"},
        per_step=[
            "execute",
            "down_blocks[0] ran",
            "fetch down_block_res_samples",
            "mid_block ran",
            "fetch mid_block_res_sample",
            "done",
        ],
        changes=dict(num_inference_steps=2),
    )

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.loras = dict(SD_LORAS)
        self._pipes: dict[tuple[bool, bool], Any] = {}

    def pipeline(self, controlnet: bool, lora: bool) -> Any:
        """The monolithic pipeline (with the ControlNet; with both LoRA files loaded the pipeline's
        way, ``load_lora_weights``), kept across requests."""
        key = (controlnet, lora)
        if key not in self._pipes:
            from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline

            base = self.root / "tiny-sd15"
            if controlnet:
                net = ControlNetModel.from_pretrained(self.root / "tiny-sd15-controlnet")
                pipe = StableDiffusionControlNetPipeline.from_pretrained(base, controlnet=net)
            else:
                pipe = StableDiffusionPipeline.from_pretrained(base)
            pipe.set_progress_bar_config(disable=True)
            if lora:
                with warnings.catch_warnings():  # peft warns when a second adapter is added
                    warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
                    for name, path in SD_LORAS.items():
                        pipe.load_lora_weights(str(self.root / path), adapter_name=name)
            self._pipes[key] = pipe
        return self._pipes[key]

    def build(self, root: Path) -> dict[str, Path]:
        from libs.models import tiny_sd

        built = tiny_sd.build(root)
        # A second adapter, so warm runners switch between two different LoRA files.
        tiny_sd.build_lora(built["tiny-sd15"], root / SD_LORAS["other"], seed=1)
        return built

    def base_request(self, workflow: str) -> dict[str, Any]:
        return dict(
            prompt=PROMPT.lower(),
            negative_prompt=NEGATIVE,
            seed=7,
            width=64,
            height=64,
            num_inference_steps=3,
            guidance_scale=6.0,
        )

    def control_image(self) -> Image.Image:
        # Not the output size: the pipeline's control_image_processor resizes it.
        pixels = np.random.RandomState(0).randint(0, 256, size=(72, 96, 3), dtype=np.uint8)
        return Image.fromarray(pixels, mode="RGB")

    def reference(self, workflow: str, params: dict[str, Any]) -> Result:
        control = self.control_image() if "control_image" in params else None
        lora = params.get("lora") or None
        pipe = self.pipeline(control is not None, lora is not None)
        return Result(sd_pipeline_image(self.root, params, control_image=control, lora=lora, pipe=pipe))


# -- Stable Diffusion 3 --------------------------------------------------------------------------------


class Sd3(Harness):
    family, base, denoiser = "sd3", "tiny-sd3", "sd3.transformer"
    cases = [
        ("tiny-sd3", {}, "tiny-sd3-64x64-cfg"),
        (
            "tiny-sd3",
            dict(height=128, width=64, num_inference_steps=2, seed=7, guidance_scale=1.0),
            "tiny-sd3-128x64-no-cfg",
        ),
        ("tiny-sd3-lora", dict(lora_scale=0.75, seed=3), "tiny-sd3-lora-scale-0.75"),
        (
            "tiny-sd3-controlnet",
            dict(control_scale=0.7, seed=11, height=64, width=128),
            "tiny-sd3-controlnet-64x128",
        ),
        ("tiny-sd3-controlnet-lora", dict(seed=5, num_inference_steps=2), "tiny-sd3-controlnet-lora"),
    ]
    mid_forward = MidForward(
        workflow="tiny-sd3-controlnet",
        component="transformer",
        callbacks=("control_block_samples",),
        hooks={"transformer_blocks.0": "block 0 ran"},
        per_step=["execute", "block 0 ran", "fetch control_block_samples", "done"],
        changes=dict(seed=2),
    )
    MAX_SEQ = 24

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._pipes: dict[tuple[str | None, bool], Any] = {}

    def pipeline(self, controlnet: str | None = None, lora: bool = False) -> Any:
        """The monolithic pipeline on the base folder, with the ControlNet folder ``controlnet`` and
        the family's LoRA loaded the pipeline's way (``load_lora_weights``)."""
        key = (controlnet, lora)
        if key not in self._pipes:
            from diffusers import (
                SD3ControlNetModel,
                StableDiffusion3ControlNetPipeline,
                StableDiffusion3Pipeline,
            )

            base = self.paths["tiny-sd3"]
            if controlnet is None:
                pipe = StableDiffusion3Pipeline.from_pretrained(base)
            else:
                net = SD3ControlNetModel.from_pretrained(controlnet)
                pipe = StableDiffusion3ControlNetPipeline.from_pretrained(base, controlnet=net)
            pipe.set_progress_bar_config(disable=True)
            if lora:
                pipe.load_lora_weights(self.loras[STYLE], adapter_name=STYLE)
            self._pipes[key] = pipe
        return self._pipes[key]

    def base_request(self, workflow: str) -> dict[str, Any]:
        return dict(
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            seed=0,
            height=64,
            width=64,
            num_inference_steps=3,
            guidance_scale=5.0,
            max_sequence_length=self.MAX_SEQ,
        )

    def control_image(self) -> Image.Image:
        # Not the output size: the pipeline's prepare_image resizes it, and so must sd3.control_image.
        rng = np.random.RandomState(0)
        ramp = np.linspace(0, 255, 96)[None, :, None] * np.ones((80, 96, 3))
        return Image.fromarray((0.5 * ramp + 0.5 * rng.rand(80, 96, 3) * 255).astype("uint8"))

    def reference(self, workflow: str, params: dict[str, Any], controlnet: str | None = None) -> Result:
        if "control_image" in params:
            controlnet = controlnet or str(self.paths["tiny-sd3-controlnet"])
        return Result(
            sd3_reference(self.pipeline(controlnet, bool(params.get("lora"))), params, self.control_image())
        )


def sd3_reference(pipe: Any, params: dict[str, Any], control_image: Image.Image) -> np.ndarray:
    """The SD3 pipeline's image for workflow ``params``. The ControlNet pipeline samples the control
    latents from the *global* RNG (``sd3.control_image`` from a private generator seeded with the
    request's seed), so the global RNG is seeded with ``torch.manual_seed(seed)`` right before."""
    kwargs: dict[str, Any] = {}
    if "control_image" in params:
        kwargs.update(
            control_image=control_image, controlnet_conditioning_scale=params.get("control_scale", 1.0)
        )
    if params.get("lora"):
        pipe.set_adapters([STYLE], [params.get("lora_scale", 1.0)])
    seed = params.get("seed", 0)
    torch.manual_seed(seed)
    image = pipe(
        params["prompt"],
        negative_prompt=params.get("negative_prompt", ""),
        height=params["height"],
        width=params["width"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params.get("guidance_scale", 7.0),
        generator=torch.Generator().manual_seed(seed),
        max_sequence_length=params["max_sequence_length"],
        **kwargs,
    ).images[0]
    return np.array(image)


# -- Sana ----------------------------------------------------------------------------------------------


SANA_SIZES = [
    (dict(height=512, width=512, seed=0), "512x512-a-bin-size"),
    (dict(height=500, width=500, seed=7), "500x500-binned-then-resized-back"),
    (dict(height=64, width=96, seed=3, use_resolution_binning=False), "64x96-no-binning"),
    (dict(height=384, width=672, seed=1, guidance_scale=1.0), "no-guidance"),
    (
        dict(height=448, width=576, seed=2, complex_human_instruction=False, negative_prompt=NEGATIVE),
        "no-instruction-with-negative-prompt",
    ),
]


class Sana(Harness):
    family, base, denoiser = "sana", "tiny-sana", "sana.transformer"
    step_rejects = {"use_resolution_binning": False}
    cases = [
        (w, changes, f"{w}-{label}")
        for w in ("tiny-sana", "tiny-sana-controlnet", "tiny-sana-lora", "tiny-sana-controlnet-lora")
        for changes, label in SANA_SIZES
    ]
    mid_forward = MidForward(
        workflow="tiny-sana-controlnet",
        component="transformer",
        callbacks=("controlnet_block_samples",),
        # Sana adds sample i-1 after block i (i >= 1): the first touch of the list comes after block 1.
        hooks={"transformer_blocks.0": "block0", "transformer_blocks.1": "block1"},
        per_step=["execute", "block0", "block1", "fetch controlnet_block_samples", "done"],
        changes=dict(height=512, width=512, seed=4),
    )

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._pipes: dict[tuple[bool, bool], Any] = {}

    def pipeline(self, controlnet: bool, lora: bool) -> Any:
        key = (controlnet, lora)
        if key not in self._pipes:
            import diffusers

            cls = diffusers.SanaControlNetPipeline if controlnet else diffusers.SanaPipeline
            pipe = cls.from_pretrained(self.paths["tiny-sana-controlnet" if controlnet else "tiny-sana"])
            pipe.set_progress_bar_config(disable=True)
            if lora:
                pipe.load_lora_weights(self.loras[STYLE], adapter_name=STYLE)
            self._pipes[key] = pipe
        return self._pipes[key]

    def base_request(self, workflow: str) -> dict[str, Any]:
        return dict(
            prompt=PROMPT,
            num_inference_steps=3,
            max_sequence_length=24,
            height=512,
            width=512,
            lora_scale=0.7,
            control_scale=0.8,
        )

    def control_image(self) -> Image.Image:
        rng = np.random.default_rng(0)
        return Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8), mode="RGB")

    def reference(self, workflow: str, params: dict[str, Any]) -> Result:
        control = self.control_image() if "control_image" in params else None
        pipe = self.pipeline(control is not None, bool(params.get("lora")))
        return Result(sana_pipeline_image(pipe, control, **params))


def sana_pipeline_image(pipe: Any, control: Image.Image | None = None, **params: Any) -> np.ndarray:
    """The Sana pipeline's PIL image as an array, called with the workflow parameters ``params``."""
    kwargs: dict[str, Any] = {
        "negative_prompt": params.get("negative_prompt", ""),
        "height": params["height"],
        "width": params["width"],
        "num_inference_steps": params["num_inference_steps"],
        "guidance_scale": params.get("guidance_scale", 4.5),
        "generator": torch.Generator().manual_seed(params.get("seed", 0)),
        "max_sequence_length": params["max_sequence_length"],
        "use_resolution_binning": params.get("use_resolution_binning", True),
    }
    if not params.get("complex_human_instruction", True):
        kwargs["complex_human_instruction"] = None
    if params.get("lora"):
        kwargs["attention_kwargs"] = {"scale": params.get("lora_scale", 1.0)}
    if control is not None:
        kwargs["control_image"] = control
        kwargs["controlnet_conditioning_scale"] = params.get("control_scale", 1.0)
    return np.array(pipe(params["prompt"], **kwargs).images[0])


# -- Z-Image -------------------------------------------------------------------------------------------


class ZImage(Harness):
    family, base, denoiser = "zimage", "tiny-zimage", "zimage.transformer"
    cases = [
        ("tiny-zimage", {}, "base-64x96-cfg"),
        ("tiny-zimage", dict(height=128, width=64, seed=7, guidance_scale=0.0), "base-128x64-no-cfg"),
        (
            "tiny-zimage",
            dict(seed=2, num_inference_steps=4, cfg_truncation=0.5, cfg_normalization=1.05),
            "base-cfg-truncation-and-normalization",
        ),
        ("tiny-zimage-controlnet", dict(control_scale=0.75), "controlnet-64x96-cfg"),
        ("tiny-zimage-lora", dict(lora_scale=0.8), "lora-scale-0.8"),
        ("tiny-zimage-controlnet-lora", dict(lora_scale=1.3, seed=3, height=64, width=64), "controlnet-lora"),
        ("tiny-zimage-turbo", {}, "turbo-defaults"),
        ("tiny-zimage-turbo", dict(guidance_scale=2.0, num_inference_steps=3, seed=5), "turbo-with-cfg"),
        ("tiny-zimage-turbo-controlnet", dict(control_scale=0.75, seed=6), "turbo-controlnet"),
        ("tiny-zimage-turbo-lora", dict(lora_scale=1.3, seed=4), "turbo-lora"),
        ("tiny-zimage-turbo-controlnet-lora", dict(seed=8, num_inference_steps=3), "turbo-controlnet-lora"),
    ]
    mid_forward = MidForward(
        workflow="tiny-zimage-controlnet",
        component="transformer",
        callbacks=("controlnet_block_samples", "controlnet_layer_places"),
        # the forward first looks a layer up in the samples after main layer 0
        hooks={"layers.0": "layer 0", "layers.1": "layer 1"},
        per_step=[
            "execute",
            "layer 0",
            "fetch controlnet_layer_places",
            "fetch controlnet_block_samples",
            "layer 1",
            "done",
        ],
        changes=dict(num_inference_steps=2),
    )

    def __init__(self, root: Path) -> None:
        self.decoded: list[torch.Tensor] = []  # the latents every zimage.vae_decode received
        super().__init__(root)
        self._pipes: dict[tuple[str, bool], Any] = {}

    def classes(self, **replace: type[ModelFn]) -> dict[str, type[ModelFn]]:
        from libs.models.zimage import ZImageVaeDecode

        decoded = self.decoded

        class RecordingVaeDecode(ZImageVaeDecode):
            def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
                decoded.append(inputs["latents"])
                return super().execute(components, **inputs)

        return super().classes(**{"zimage.vae_decode": RecordingVaeDecode, **replace})

    def pipeline(self, model: str, lora: bool) -> Any:
        """The monolithic pipeline on the folder ``model`` (a ``ZImageControlNetPipeline`` one for
        the ControlNet folders), with the family's LoRA loaded the pipeline's way
        (``load_lora_weights``), kept across requests."""
        key = (model, lora)
        if key not in self._pipes:
            from diffusers import ZImageControlNetPipeline, ZImagePipeline

            cls = ZImageControlNetPipeline if model.endswith("-controlnet") else ZImagePipeline
            pipe = cls.from_pretrained(self.paths[model])
            pipe.set_progress_bar_config(disable=True)
            if lora:
                pipe.load_lora_weights(self.loras[STYLE], adapter_name=STYLE)
            self._pipes[key] = pipe
        return self._pipes[key]

    def base_request(self, workflow: str) -> dict[str, Any]:
        """64x96 (not square), seed 11; base with 3 steps and CFG, Turbo with its defaults."""
        params: dict[str, Any] = dict(
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            height=64,
            width=96,
            seed=11,
            lora_scale=0.7,
            control_scale=0.8,
        )
        if "turbo" not in workflow:
            params.update(num_inference_steps=3, guidance_scale=4.0)
        return params

    def control_image(self) -> Image.Image:
        # Not the output size: the pipeline (and zimage.control_encode) resize it.
        pixels = np.random.default_rng(5).integers(0, 256, (80, 72, 3), dtype=np.uint8)
        return Image.fromarray(pixels, "RGB")

    def run(self, runner: LocalRunner, workflow: str, params: dict[str, Any], **images: Any) -> Result:
        image = super().run(runner, workflow, params, **images).image
        return Result(image, self.decoded[-1])

    def reference(self, workflow: str, params: dict[str, Any]) -> Result:
        model = "tiny-zimage-turbo" if "turbo" in workflow else "tiny-zimage"
        kwargs: dict[str, Any] = {}
        if "control_image" in params:
            model += "-controlnet"
            kwargs.update(
                control_image=self.control_image(), controlnet_conditioning_scale=params["control_scale"]
            )
        lora = bool(params.get("lora"))
        pipe = self.pipeline(model, lora)
        if lora:
            pipe.set_adapters([STYLE], [params.get("lora_scale", 1.0)])  # what LoraSwitch does
        outputs = [
            pipe(
                params["prompt"],
                negative_prompt=params["negative_prompt"],
                height=params["height"],
                width=params["width"],
                num_inference_steps=params["num_inference_steps"],
                guidance_scale=params["guidance_scale"],
                cfg_normalization=params["cfg_normalization"],
                cfg_truncation=params["cfg_truncation"],
                generator=torch.Generator().manual_seed(params["seed"]),
                max_sequence_length=params["max_sequence_length"],
                output_type=output_type,
                **kwargs,
            ).images
            for output_type in ("pil", "latent")
        ]
        return Result(np.array(outputs[0][0]), outputs[1])


# -- Flux.2 Klein --------------------------------------------------------------------------------------


class Flux2(Harness):
    family, base, denoiser = "flux2", "tiny-flux2-klein", "flux2.transformer"
    cases = [
        ("tiny-flux2-klein", {}, "base-64x96-cfg"),
        ("tiny-flux2-klein", dict(height=128, width=64, seed=7, guidance_scale=1.0), "base-128x64-no-cfg"),
        ("tiny-flux2-klein", dict(height=80, width=48, seed=3, num_inference_steps=2), "base-80x48-2-steps"),
        ("tiny-flux2-klein-lora", dict(lora_scale=0.8), "lora-scale-0.8"),
        ("tiny-flux2-klein-lora", dict(lora_scale=1.3, guidance_scale=1.0, seed=4), "lora-no-cfg"),
        ("tiny-flux2-klein-edit", {}, "edit-1-reference-cfg"),
        (
            "tiny-flux2-klein-edit",
            dict(image_2=REF_2, guidance_scale=1.0, seed=6),
            "edit-2-references-no-cfg",
        ),
    ]
    mid_forward = None  # diffusers has no Flux.2 Klein ControlNet pipeline
    # The edit's reference pictures (request name -> width, height): sizes and aspect ratios of their
    # own, none the output's, none a multiple of 4 (the pipeline rounds them down and crops).
    reference_sizes = {INIT: (97, 70), REF_2: (66, 130), REF_3: (151, 89)}

    def __init__(self, root: Path) -> None:
        self.decoded: list[torch.Tensor] = []  # the latents every flux2.vae_decode received
        super().__init__(root)
        self._pipes: dict[tuple[str, bool], Any] = {}

    def classes(self, **replace: type[ModelFn]) -> dict[str, type[ModelFn]]:
        from libs.models.flux2 import Flux2VaeDecode

        decoded = self.decoded

        class RecordingVaeDecode(Flux2VaeDecode):
            def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
                decoded.append(inputs["latents"])
                return super().execute(components, **inputs)

        return super().classes(**{"flux2.vae_decode": RecordingVaeDecode, **replace})

    def pipeline(self, model: str | Path, lora: bool) -> Any:
        """``Flux2KleinPipeline`` on the folder ``model`` (a name in :attr:`paths` or a path), with
        the family's LoRA loaded the pipeline's way (``load_lora_weights``), kept across requests."""
        key = (str(model), lora)
        if key not in self._pipes:
            from diffusers import Flux2KleinPipeline

            pipe = Flux2KleinPipeline.from_pretrained(self.paths.get(str(model), model))
            pipe.set_progress_bar_config(disable=True)
            if lora:
                pipe.load_lora_weights(self.loras[STYLE], adapter_name=STYLE)
            self._pipes[key] = pipe
        return self._pipes[key]

    def base_request(self, workflow: str) -> dict[str, Any]:
        """64x96 (not square), seed 11, 3 steps with CFG; the LoRA at 0.7."""
        return dict(
            prompt=PROMPT,
            height=64,
            width=96,
            seed=11,
            num_inference_steps=3,
            guidance_scale=4.0,
            max_sequence_length=96,
            lora_scale=0.7,
        )

    def control_image(self) -> Image.Image:
        return Image.new("RGB", (8, 8))  # no workflow of the family reads it (no ControlNet)

    def reference_picture(self, name: str) -> Image.Image:
        """The edit's reference picture ``name`` (a key of :attr:`reference_sizes`): noise over a
        colour ramp of its own, so that every picture differs."""
        width, height = self.reference_sizes[name]
        rng = np.random.default_rng(list(self.reference_sizes).index(name) + 20)
        ramp = np.linspace(0, 180, width)[None, :, None] * rng.uniform(0.3, 1.0, 3)
        rgb = ramp + rng.integers(0, 76, (height, width, 3))
        return Image.fromarray(rgb.astype(np.uint8), "RGB")

    def edit_pictures(self, params: dict[str, Any]) -> list[str]:
        """The reference pictures a request to the edit names, in the order the pipeline gets them."""
        return [params[n] for n in ("image", "image_2", "image_3") if params.get(n)]

    def images(self, workflow: str, params: dict[str, Any]) -> dict[str, Any]:
        edit = workflow.endswith("-edit")
        refs = {n: self.reference_picture(n) for n in self.edit_pictures(params)} if edit else {}
        return {**super().images(workflow, params), **refs}

    def run(self, runner: LocalRunner, workflow: str, params: dict[str, Any], **images: Any) -> Result:
        image = super().run(runner, workflow, params, **images).image
        return Result(image, self.decoded[-1])

    def reference(self, workflow: str, params: dict[str, Any], model: str | Path | None = None) -> Result:
        pipe = self.pipeline(model or self.base, bool(params.get("lora")))
        if workflow.endswith("-edit"):
            pictures = [self.reference_picture(n) for n in self.edit_pictures(params)]
            return flux2_pipeline_result(pipe, params, image=pictures)
        return flux2_pipeline_result(pipe, params)


def flux2_pipeline_result(pipe: Any, params: dict[str, Any], **extra: Any) -> Result:
    """The Klein pipeline's image and its packed latents after the last step (what
    ``flux2.vae_decode`` receives), for the workflow parameters ``params`` (``extra``: further
    arguments of the pipeline, e.g. the edit's reference pictures ``image``)."""
    if params.get("lora"):
        pipe.set_adapters([STYLE], [params.get("lora_scale", 1.0)])  # what LoraSwitch does
    final: list[torch.Tensor] = []

    def keep_latents(_pipe: Any, _i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        final[:] = [kwargs["latents"]]
        return {}

    image = pipe(
        prompt=params["prompt"],
        height=params["height"],
        width=params["width"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params["guidance_scale"],
        generator=torch.Generator().manual_seed(params["seed"]),
        max_sequence_length=params["max_sequence_length"],
        callback_on_step_end=keep_latents,
        **extra,
    ).images[0]
    return Result(np.array(image), final[0])


# -- Qwen-Image ----------------------------------------------------------------------------------------


class QwenImage(Harness):
    family, base, denoiser = "qwenimage", "tiny-qwenimage", "qwenimage.transformer"
    cases = [
        ("tiny-qwenimage", {}, "base-64x96-true-cfg"),
        ("tiny-qwenimage", dict(height=128, width=64, seed=7, true_cfg_scale=1.0), "base-128x64-no-cfg"),
        ("tiny-qwenimage", dict(seed=2, max_sequence_length=8, negative_prompt=""), "base-truncated-prompt"),
        ("tiny-qwenimage-lora", dict(lora_scale=0.8), "lora-scale-0.8"),
        ("tiny-qwenimage-controlnet", dict(control_scale=0.75), "controlnet-64x96-true-cfg"),
        (
            "tiny-qwenimage-controlnet",
            dict(true_cfg_scale=1.0, seed=4, height=64, width=64),
            "controlnet-no-cfg",
        ),
        ("tiny-qwenimage-controlnet-lora", dict(lora_scale=1.3, seed=3), "controlnet-lora"),
        ("tiny-qwenimage-edit", {}, "edit-64x64-true-cfg"),
        (
            "tiny-qwenimage-edit",
            dict(height=64, width=96, seed=5, true_cfg_scale=1.0, num_inference_steps=2),
            "edit-64x96-no-cfg",
        ),
        ("tiny-qwenimage-edit-plus", {}, "edit-plus-one-picture"),
        ("tiny-qwenimage-edit-plus", dict(image_2=SECOND, image_3=THIRD), "edit-plus-three-pictures"),
    ]
    mid_forward = MidForward(
        workflow="tiny-qwenimage-controlnet",
        component="transformer",
        callbacks=("controlnet_block_samples",),
        # the forward first reads the samples after block 0; the true-CFG pass reuses them
        hooks={"transformer_blocks.0": "block 0", "transformer_blocks.1": "block 1"},
        per_step=[
            "execute",
            "block 0",
            "fetch controlnet_block_samples",
            "block 1",
            "block 0",
            "block 1",
            "done",
        ],
        changes=dict(num_inference_steps=2),
    )

    def __init__(self, root: Path) -> None:
        self.decoded: list[torch.Tensor] = []  # the latents every qwenimage.vae_decode received
        super().__init__(root)
        self._pipes: dict[tuple[str, bool], Any] = {}

    def classes(self, **replace: type[ModelFn]) -> dict[str, type[ModelFn]]:
        from libs.models.qwenimage import QwenImageVaeDecode

        decoded = self.decoded

        class RecordingVaeDecode(QwenImageVaeDecode):
            def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
                decoded.append(inputs["latents"])
                return super().execute(components, **inputs)

        return super().classes(**{"qwenimage.vae_decode": RecordingVaeDecode, **replace})

    def pipeline(self, model: str, lora: bool) -> Any:
        """The monolithic pipeline on the folder ``model`` (the edit folder: ``QwenImageEditPipeline``
        with its VL processor), with the family's LoRA loaded the pipeline's way, kept across requests."""
        key = (model, lora)
        if key not in self._pipes:
            from diffusers import QwenImageEditPipeline, QwenImagePipeline

            from libs.models.qwenimage_loading import vl_processor

            if model in ("tiny-qwenimage-edit", "tiny-qwenimage-edit-plus"):
                from diffusers import QwenImageEditPlusPipeline

                path = self.paths["tiny-qwenimage-edit"]  # the Plus pipeline runs on the same folder
                cls = QwenImageEditPlusPipeline if model.endswith("-plus") else QwenImageEditPipeline
                pipe = cls.from_pretrained(path, processor=vl_processor(str(path)))
            elif model == "tiny-qwenimage-controlnet":
                from diffusers import QwenImageControlNetPipeline

                pipe = QwenImageControlNetPipeline.from_pretrained(self.paths[model])
            else:
                pipe = QwenImagePipeline.from_pretrained(self.paths[model])
            pipe.set_progress_bar_config(disable=True)
            if lora:
                pipe.load_lora_weights(self.loras[STYLE], adapter_name=STYLE)
            self._pipes[key] = pipe
        return self._pipes[key]

    def base_request(self, workflow: str) -> dict[str, Any]:
        """64x96 (not square; the edit 64x64), 3 steps, true CFG, seed 11."""
        params: dict[str, Any] = dict(
            control_scale=0.8,
            prompt=PROMPT,
            negative_prompt=NEGATIVE,
            height=64,
            width=96,
            seed=11,
            num_inference_steps=3,
        )
        if "edit" in workflow:
            params.update(width=64, prompt="make the cat blue")
        return {**params, "lora_scale": 0.7}

    def control_image(self) -> Image.Image:
        # Not the output size: the pipeline (and qwenimage.control_encode) resize it.
        pixels = np.random.default_rng(6).integers(0, 256, (72, 80, 3), dtype=np.uint8)
        return Image.fromarray(pixels, "RGB")

    def edit_image(self) -> Image.Image:
        """The edit's input picture (``image`` = INIT): neither the output size nor its aspect
        ratio, as the pipeline resizes it."""
        pixels = np.random.default_rng(3).integers(0, 256, (60, 84, 3), dtype=np.uint8)
        return Image.fromarray(pixels, "RGB")

    def more_pictures(self) -> dict[str, Image.Image]:
        """The Plus edit's further pictures: another size, and a tall one."""
        rng = np.random.default_rng(4)
        return {
            SECOND: Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), "RGB"),
            THIRD: Image.fromarray(rng.integers(0, 256, (90, 40, 3), dtype=np.uint8), "RGB"),
        }

    def images(self, workflow: str, params: dict[str, Any]) -> dict[str, Any]:
        edit = {INIT: self.edit_image(), **self.more_pictures()} if "image" in params else {}
        return {**super().images(workflow, params), **edit}

    def run(self, runner: LocalRunner, workflow: str, params: dict[str, Any], **images: Any) -> Result:
        image = super().run(runner, workflow, params, **images).image
        return Result(image, self.decoded[-1])

    def reference(self, workflow: str, params: dict[str, Any]) -> Result:
        edit, controlnet = "image" in params, "control_image" in params
        lora = bool(params.get("lora"))
        model = "tiny-qwenimage-controlnet" if controlnet else "tiny-qwenimage"
        if edit:
            model = "tiny-qwenimage-edit-plus" if workflow.endswith("-plus") else "tiny-qwenimage-edit"
        pipe = self.pipeline(model, lora)
        if lora:
            pipe.set_adapters([STYLE], [params.get("lora_scale", 1.0)])  # what LoraSwitch does
        kwargs: dict[str, Any] = {"image": self.edit_image()} if edit else {}
        if model == "tiny-qwenimage-edit-plus":
            more = self.more_pictures()
            extra = [more[params[n]] for n in ("image_2", "image_3") if params.get(n)]
            kwargs["image"] = [self.edit_image(), *extra]
        if controlnet:
            kwargs.update(
                control_image=self.control_image(), controlnet_conditioning_scale=params["control_scale"]
            )
        outputs = [
            pipe(
                prompt=params["prompt"],
                negative_prompt=params["negative_prompt"],
                true_cfg_scale=params["true_cfg_scale"],
                height=params["height"],
                width=params["width"],
                num_inference_steps=params["num_inference_steps"],
                generator=torch.Generator().manual_seed(params["seed"]),
                max_sequence_length=params["max_sequence_length"],
                output_type=output_type,
                **kwargs,
            ).images
            for output_type in ("pil", "latent")
        ]
        return Result(np.array(outputs[0][0]), outputs[1])


# -- one harness per family, built once per session ----------------------------------------------------

HARNESSES: dict[str, type[Harness]] = {h.family: h for h in (Flux, Sd, Sd3, Sana, ZImage, Flux2, QwenImage)}
FAMILIES = list(HARNESSES)
assert FAMILIES == list(families.FAMILIES), "a harness per family, in the catalog's order"
_BUILT: dict[str, Harness] = {}


def harness(family: str, tmp_path_factory: pytest.TempPathFactory) -> Harness:
    """The family's harness; the first call builds its models under a session temporary folder."""
    if family not in _BUILT:
        _BUILT[family] = HARNESSES[family](tmp_path_factory.mktemp(f"models-{family}"))
    return _BUILT[family]


def submodule(model: Any, path: str) -> Any:
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model
