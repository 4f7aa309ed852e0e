"""The image-to-image and inpainting workflows, run node by node, equal their diffusers pipelines bitwise
(final latents and image) at a strength that cuts steps and at 1.0, and unroll as many denoising
steps as the pipelines' ``get_timesteps`` leave. The harnesses are :mod:`tests.unit.model_families`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from libs.workflow.dag import unroll
from libs.workflow.local import LocalRunner
from libs.workflow.modelfn import ModelFn
from libs.workflow.params import resolve_params
from tests.unit.model_families import INIT, MASK, Harness, Result, harness

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

# workflow -> (family, the pipeline class name, the ModelFn of the denoiser)
WORKFLOWS = {
    "tiny-sd15-img2img": ("sd", "StableDiffusionImg2ImgPipeline", "sd.unet"),
    "tiny-sd15-inpaint": ("sd", "StableDiffusionInpaintPipeline", "sd.unet"),
    "tiny-flux-img2img": ("flux", "FluxImg2ImgPipeline", "flux.transformer"),
    "tiny-flux-inpaint": ("flux", "FluxInpaintPipeline", "flux.transformer"),
    "tiny-sd3-img2img": ("sd3", "StableDiffusion3Img2ImgPipeline", "sd3.transformer"),
    "tiny-sd3-inpaint": ("sd3", "StableDiffusion3InpaintPipeline", "sd3.transformer"),
    "tiny-zimage-img2img": ("zimage", "ZImageImg2ImgPipeline", "zimage.transformer"),
    "tiny-zimage-inpaint": ("zimage", "ZImageInpaintPipeline", "zimage.transformer"),
    "tiny-flux2-klein-inpaint": ("flux2", "Flux2KleinInpaintPipeline", "flux2.transformer"),
    "tiny-qwenimage-img2img": ("qwenimage", "QwenImageImg2ImgPipeline", "qwenimage.transformer"),
    "tiny-qwenimage-inpaint": ("qwenimage", "QwenImageInpaintPipeline", "qwenimage.transformer"),
}


def picture(width: int, height: int) -> Image.Image:
    """A picture to start from: a colour ramp with noise, a pixel larger than the output (the
    pipelines round its size down to the VAE's multiple, or resize it)."""
    rng = np.random.default_rng(5)
    w, h = width + 1, height + 1
    ramp = np.stack(np.meshgrid(np.linspace(0, 1, w), np.linspace(0, 1, h)), -1)
    rgb = np.concatenate([ramp, ramp[..., :1] * ramp[..., 1:]], -1) * 200 + rng.integers(0, 56, (h, w, 3))
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def mask_picture(width: int, height: int) -> Image.Image:
    """White (repaint) in a rectangle, black elsewhere, with greys on both sides of the binarising
    threshold (0.5) around it."""
    m = np.zeros((height, width), np.uint8)
    m[height // 4 : 3 * height // 4, width // 3 :] = 255
    m[: height // 4, : width // 2] = 100  # below 0.5: kept
    m[3 * height // 4 :, width // 3 :] = 160  # above 0.5: repainted
    return Image.fromarray(m, "L")


_PIPES: dict[tuple[str, str], Any] = {}
_RUNNERS: dict[str, tuple[LocalRunner, list[torch.Tensor]]] = {}


def pipeline(h: Harness, cls_name: str) -> Any:
    import diffusers

    key = (h.family, cls_name)
    if key not in _PIPES:
        pipe = getattr(diffusers, cls_name).from_pretrained(h.paths.get(h.base, h.root / h.base))
        pipe.set_progress_bar_config(disable=True)
        _PIPES[key] = pipe
    return _PIPES[key]


def recording_runner(h: Harness) -> tuple[LocalRunner, list[torch.Tensor]]:
    """A runner whose VAE decoders record the latents they get (the workflow's final latents)."""
    if h.family not in _RUNNERS:
        decoded: list[torch.Tensor] = []

        def recording(base: type[ModelFn]) -> type[ModelFn]:
            class Recording(base):  # type: ignore[valid-type,misc]
                def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
                    decoded.append(inputs["latents"])
                    return super().execute(components, **inputs)

            return Recording

        decoders = {n: recording(c) for n, c in h.classes().items() if n.endswith("vae_decode")}
        _RUNNERS[h.family] = (LocalRunner(h.root, classes=h.classes(**decoders)), decoded)
    return _RUNNERS[h.family]


def edit_images(params: dict[str, Any]) -> dict[str, Image.Image]:
    """The pictures a request to an edit workflow names: the picture and, inpainting, the mask."""
    images = {INIT: picture(params["width"], params["height"])}
    if "mask" in params:
        images[MASK] = mask_picture(params["width"], params["height"])
    return images


def run(h: Harness, workflow: str, params: dict[str, Any]) -> Result:
    runner, decoded = recording_runner(h)
    image = h.run(runner, workflow, params, **edit_images(params)).image
    return Result(image, decoded[-1])


def pipeline_kwargs(family: str, workflow: str, params: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        image=picture(params["width"], params["height"]),
        strength=params["strength"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params.get("guidance_scale"),  # qwenimage's: None, the pipelines' default
    )
    if family in ("sd", "sd3", "zimage", "qwenimage"):
        kwargs["negative_prompt"] = params["negative_prompt"]
    if family == "zimage":
        kwargs.update(cfg_normalization=params["cfg_normalization"], cfg_truncation=params["cfg_truncation"])
    if family == "qwenimage":
        kwargs["true_cfg_scale"] = params["true_cfg_scale"]
    if family == "sd":
        if "mask" in params:  # the img2img pipeline takes no size: the picture's, rounded down
            kwargs.update(height=params["height"], width=params["width"])
    else:
        kwargs.update(
            height=params["height"], width=params["width"], max_sequence_length=params["max_sequence_length"]
        )
    if "mask" in params:
        kwargs["mask_image"] = mask_picture(params["width"], params["height"])
    return kwargs


def reference(h: Harness, workflow: str, params: dict[str, Any]) -> Result:
    family, cls_name, _ = WORKFLOWS[workflow]
    pipe = pipeline(h, cls_name)
    if family == "flux2":
        return last_step_reference(pipe, family, workflow, params)
    outputs = [
        pipe(
            params["prompt"],
            generator=torch.Generator().manual_seed(params["seed"]),
            output_type=output_type,
            **pipeline_kwargs(family, workflow, params),
        ).images
        for output_type in ("pil", "latent")
    ]
    return Result(np.array(outputs[0][0]), outputs[1])


def last_step_reference(pipe: Any, family: str, workflow: str, params: dict[str, Any]) -> Result:
    """The image and the latents after the last step's blend, as the step callback sees them (the
    packed latents the VAE decoder gets; Flux.2's ``output_type="latent"`` unpacks them)."""
    final: list[torch.Tensor] = []

    def keep_latents(_pipe: Any, _i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        final[:] = [kwargs["latents"]]
        return {}

    image = pipe(
        params["prompt"],
        generator=torch.Generator().manual_seed(params["seed"]),
        callback_on_step_end=keep_latents,
        **pipeline_kwargs(family, workflow, params),
    ).images[0]
    return Result(np.array(image), final[0])


CASES = [
    pytest.param("tiny-sd15-img2img", dict(num_inference_steps=5, strength=0.6), id="sd15-img2img-0.6"),
    pytest.param(
        "tiny-sd15-img2img",
        dict(num_inference_steps=3, strength=1.0, width=128, guidance_scale=1.0),
        id="sd15-img2img-1.0-128x64-no-cfg",
    ),
    pytest.param("tiny-sd15-inpaint", dict(num_inference_steps=5, strength=0.6), id="sd15-inpaint-0.6"),
    pytest.param("tiny-sd15-inpaint", dict(num_inference_steps=3, strength=1.0), id="sd15-inpaint-1.0"),
    pytest.param(
        "tiny-sd15-inpaint",
        dict(num_inference_steps=4, strength=0.75, height=128, guidance_scale=1.0, seed=2),
        id="sd15-inpaint-0.75-64x128-no-cfg",
    ),
    pytest.param("tiny-flux-img2img", dict(num_inference_steps=4, strength=0.6), id="flux-img2img-0.6"),
    pytest.param(
        "tiny-flux-img2img",
        dict(num_inference_steps=3, strength=1.0, height=96, seed=3),
        id="flux-img2img-1.0",
    ),
    pytest.param("tiny-flux-inpaint", dict(num_inference_steps=4, strength=0.6), id="flux-inpaint-0.6"),
    pytest.param(
        "tiny-flux-inpaint", dict(num_inference_steps=3, strength=1.0, width=64), id="flux-inpaint-1.0-64x64"
    ),
    pytest.param("tiny-sd3-img2img", dict(num_inference_steps=4, strength=0.6), id="sd3-img2img-0.6"),
    pytest.param(
        "tiny-sd3-img2img",
        dict(num_inference_steps=3, strength=1.0, width=128, guidance_scale=1.0),
        id="sd3-img2img-1.0-128x64-no-cfg",
    ),
    pytest.param("tiny-sd3-inpaint", dict(num_inference_steps=5, strength=0.6), id="sd3-inpaint-0.6"),
    pytest.param("tiny-sd3-inpaint", dict(num_inference_steps=3, strength=1.0, seed=4), id="sd3-inpaint-1.0"),
    pytest.param("tiny-zimage-img2img", dict(num_inference_steps=4, strength=0.6), id="zimage-img2img-0.6"),
    pytest.param(
        "tiny-zimage-img2img",
        dict(num_inference_steps=3, strength=1.0, guidance_scale=0.0, height=64),
        id="zimage-img2img-1.0-64x64-no-cfg",
    ),
    pytest.param("tiny-zimage-inpaint", dict(num_inference_steps=5, strength=0.6), id="zimage-inpaint-0.6"),
    pytest.param(
        "tiny-zimage-inpaint", dict(num_inference_steps=3, strength=1.0, seed=4), id="zimage-inpaint-1.0"
    ),
    pytest.param(
        "tiny-flux2-klein-inpaint", dict(num_inference_steps=5, strength=0.6), id="flux2-klein-inpaint-0.6"
    ),
    pytest.param(
        "tiny-flux2-klein-inpaint",
        dict(num_inference_steps=3, strength=1.0, guidance_scale=1.0, width=64, seed=4),
        id="flux2-klein-inpaint-1.0-64x64-no-cfg",
    ),
    pytest.param(
        "tiny-qwenimage-img2img", dict(num_inference_steps=4, strength=0.6), id="qwenimage-img2img-0.6"
    ),
    pytest.param(
        "tiny-qwenimage-img2img",
        dict(num_inference_steps=3, strength=1.0, true_cfg_scale=1.0, height=64, seed=3),
        id="qwenimage-img2img-1.0-64x64-no-cfg",
    ),
    pytest.param(
        "tiny-qwenimage-inpaint", dict(num_inference_steps=5, strength=0.6), id="qwenimage-inpaint-0.6"
    ),
    pytest.param(
        "tiny-qwenimage-inpaint",
        dict(num_inference_steps=3, strength=1.0, seed=4, height=128),
        id="qwenimage-inpaint-1.0-128x96",
    ),
]


@pytest.mark.parametrize(("workflow", "changes"), CASES)
def test_each_edit_workflow_run_node_by_node_equals_its_pipeline_bitwise(
    workflow: str, changes: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    h = harness(WORKFLOWS[workflow][0], tmp_path_factory)
    params = h.request(workflow, **changes)

    got = run(h, workflow, params)
    expected = reference(h, workflow, params)

    assert got.image.shape == (params["height"], params["width"], 3)
    assert np.unique(got.image).size > 10, "a flat image would make the comparison meaningless"
    assert got.latents is not None and expected.latents is not None
    assert torch.equal(got.latents, expected.latents)
    assert np.array_equal(got.image, expected.image)


@pytest.mark.parametrize("workflow", list(WORKFLOWS))
def test_the_unrolled_dag_has_as_many_denoising_steps_as_the_pipelines_get_timesteps_leave(
    workflow: str,
) -> None:
    import diffusers

    from libs.models import families

    family, cls_name, denoiser = WORKFLOWS[workflow]
    (spec,) = [s for s in families.FAMILIES[family].module("workflows").workflows() if s.name == workflow]
    get_timesteps = getattr(diffusers, cls_name).get_timesteps
    for steps in (1, 3, 4, 5, 10, 28):
        for strength in (0.25, 0.5, 0.6, 0.75, 0.9, 1.0):
            scheduler = SimpleNamespace(timesteps=torch.arange(steps), order=1)
            timesteps, n = get_timesteps(SimpleNamespace(scheduler=scheduler), steps, strength, "cpu")
            params = {"prompt": "x", "image": INIT, "mask": MASK, "num_inference_steps": steps}
            params = {k: v for k, v in params.items() if k in spec.params}
            if n < 1:
                continue  # the pipelines fail too; test_loop_fraction checks the ParamError
            dag = unroll(spec, resolve_params(spec, {**params, "strength": strength}))
            run_steps = [node for node in dag.nodes.values() if node.fn == denoiser]
            assert len(run_steps) == n == len(timesteps), (steps, strength)
            assert [node.inputs["step"].value for node in run_steps] == list(  # type: ignore[union-attr]
                range(steps - n, steps)
            )
            if family == "sd":
                assert n == int(steps * strength)


def test_an_all_black_mask_keeps_the_picture_and_an_all_white_one_repaints_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from libs.models.sd_img2img import SdInpaintLatents

    h = harness("sd", tmp_path_factory)
    params = h.request("tiny-sd15-inpaint", num_inference_steps=3, strength=1.0)
    runner, decoded = recording_runner(h)
    init = picture(64, 64)
    black, white = Image.new("L", (64, 64), 0), Image.new("L", (64, 64), 255)
    prepare = SdInpaintLatents()
    inputs = {k: params[k] for k in ("seed", "height", "width", "num_inference_steps", "strength")}
    prepared = prepare.execute(
        prepare.load_model(str(h.root / h.base), "cpu"), image=init, mask=black, **inputs
    )

    h.run(runner, "tiny-sd15-inpaint", params, **{INIT: init, MASK: black})
    kept = decoded[-1]
    h.run(runner, "tiny-sd15-inpaint", params, **{INIT: init, MASK: white})
    repainted = decoded[-1]

    # The last step's blend puts the picture's latents back unnoised wherever the mask is black.
    assert torch.equal(kept, prepared["image_latents"])
    assert not torch.equal(repainted, kept)


@pytest.mark.parametrize("workflow", list(WORKFLOWS))
def test_each_edit_workflow_at_bf16_over_the_weight_cache_equals_its_pipeline_loaded_at_bf16(
    workflow: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The picture, the noise and the mask take the dtype the executor loads the text encoder and
    the VAE at (the pipelines cast them to ``prompt_embeds.dtype``), not the one in their configs."""
    import diffusers

    from libs.dataplane.loader import Loader
    from libs.models.families import parse_dtypes
    from services.executor.runtime import ModelCache

    family, cls_name, _ = WORKFLOWS[workflow]
    h = harness(family, tmp_path_factory)
    params = h.request(workflow, **next(c.values[1] for c in CASES if c.values[0] == workflow))  # type: ignore[union-attr]
    pipe = getattr(diffusers, cls_name).from_pretrained(
        h.paths.get(h.base, h.root / h.base), torch_dtype=torch.bfloat16
    )
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        params["prompt"],
        generator=torch.Generator().manual_seed(params["seed"]),
        **pipeline_kwargs(family, workflow, params),
    ).images[0]

    with Loader() as loader:
        cache = ModelCache(h.root, "cpu", loader, parse_dtypes(f"{h.base}=bfloat16"))
        runner = LocalRunner(h.root, classes=h.classes(), models=cache)
        got = h.run(runner, workflow, params, **edit_images(params)).image

    assert np.unique(got).size > 10
    assert np.array_equal(got, np.array(expected))


@pytest.mark.parametrize(
    "workflow",
    [
        "tiny-flux-inpaint",
        "tiny-sd3-inpaint",
        "tiny-zimage-inpaint",
        "tiny-flux2-klein-inpaint",
        "tiny-qwenimage-inpaint",
    ],
)
def test_each_flow_matching_blend_puts_the_picture_back_unnoised_last_and_refuses_another_schedule(
    workflow: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The blends share :class:`~libs.models.common.FlowMatchInpaintBlend`; each family's builds
    its own schedule, which the carried timesteps must be."""
    from libs.models.common import FlowMatchInpaintBlend

    family = WORKFLOWS[workflow][0]
    h = harness(family, tmp_path_factory)
    blend = h.classes()[f"{family}.inpaint_blend"]
    assert issubclass(blend, FlowMatchInpaintBlend)
    calls: list[tuple[dict[str, Any], dict[str, Any], torch.Tensor]] = []

    class Recording(blend):  # type: ignore[valid-type,misc]
        def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
            out = super().execute(components, **inputs)
            calls.append((components, inputs, out["latents"]))
            return out

    params = h.request(workflow, num_inference_steps=4, strength=1.0)
    runner = LocalRunner(h.root, classes=h.classes(**{blend.fn_name: Recording}))
    h.run(runner, workflow, params, **edit_images(params))

    assert [int(inputs["step"]) for _, inputs, _ in calls] == [0, 1, 2, 3]
    components, inputs, out = calls[-1]
    mask, picture = inputs["init_mask"], inputs[blend.image_input]
    assert torch.equal(out, (1 - mask) * picture + mask * inputs["latents"])
    components, inputs, out = calls[0]
    node = blend()
    assert torch.equal(node.execute(components, **inputs)["latents"], out)
    five_steps = node.scheduler(components, 5, inputs["latents"]).timesteps
    with pytest.raises(ValueError, match="timesteps do not match a 4-step schedule"):
        node.execute(components, **{**inputs, "timesteps": five_steps[:4]})
