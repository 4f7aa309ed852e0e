"""The SD1.5 workflows, run node by node by LocalRunner, reproduce diffusers' StableDiffusionPipeline
and StableDiffusionControlNetPipeline bitwise (tiny random models, CFG, ControlNet, LoRA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from libs.models import sd, tiny_sd
from libs.models.sd_workflows import MODELFNS, workflows
from libs.workflow.local import LocalRunner
from libs.workflow.modelfn import Deferred

REPO = Path(__file__).resolve().parents[2]
PROMPT = "a photo of a cat holding a sign that says 'hello world', 4k!"
NEGATIVE = "blurry, low quality"
STYLE = "loras/tiny-sd15-style.safetensors"
OTHER = "loras/tiny-sd15-other.safetensors"
LORAS = {"style": STYLE, "other": OTHER}
CLASSES = {cls.fn_name: cls for cls in MODELFNS}

EXPECTED_IO = {
    "sd.text_encoder": (
        {"prompt": False, "negative_prompt": False, "guidance_scale": False},
        ["prompt_embeds"],
    ),
    "sd.prepare_latents": (
        {"seed": False, "height": False, "width": False, "num_inference_steps": False},
        ["latents", "timesteps"],
    ),
    "sd.control_image": ({"control_image": False, "height": False, "width": False}, ["control_cond"]),
    "sd.controlnet": (
        {
            "latents": False,
            "timesteps": False,
            "step": False,
            "prompt_embeds": False,
            "control_cond": False,
            "control_scale": False,
        },
        ["down_block_res_samples", "mid_block_res_sample"],
    ),
    "sd.unet": (
        {
            "latents": False,
            "timesteps": False,
            "step": False,
            "guidance_scale": False,
            "prompt_embeds": False,
            "down_block_res_samples": True,
            "mid_block_res_sample": True,
            "lora": False,
            "lora_scale": False,
        },
        ["noise_pred"],
    ),
    "sd.ddim_step": (
        {
            "noise_pred": False,
            "latents": False,
            "timesteps": False,
            "step": False,
            "num_inference_steps": False,
        },
        ["latents"],
    ),
    "sd.vae_decode": ({"latents": False}, ["image"]),
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # The thread count changes the bits (NOTES-diffusers.md): pin it for pipeline and nodes alike.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models")
    built = tiny_sd.build(out)
    tiny_sd.build_lora(built["tiny-sd15"], out / OTHER, seed=1)
    return out


@pytest.fixture(scope="module")
def specs() -> dict[str, Any]:
    return {spec.name: spec for spec in workflows()}


@pytest.fixture(scope="module")
def runner(root: Path) -> LocalRunner:
    """One warm runner for the module, as an executor keeps its models across requests."""
    return LocalRunner(root, classes=CLASSES)


@pytest.fixture(scope="module")
def control_image() -> Image.Image:
    # Not the output size: the pipeline's control_image_processor resizes it.
    pixels = np.random.RandomState(0).randint(0, 256, size=(72, 96, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def pipeline_image(
    root: Path,
    params: dict[str, Any],
    *,
    control_image: Image.Image | None = None,
    lora: str | None = None,
) -> np.ndarray:
    """The monolithic pipeline's image for the same request, on a freshly loaded pipeline."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline

    kwargs: dict[str, Any] = dict(
        negative_prompt=params.get("negative_prompt", ""),
        height=params["height"],
        width=params["width"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params["guidance_scale"],
        generator=torch.Generator().manual_seed(params["seed"]),
    )
    if control_image is None:
        pipe = StableDiffusionPipeline.from_pretrained(root / "tiny-sd15")
    else:
        controlnet = ControlNetModel.from_pretrained(root / "tiny-sd15-controlnet")
        pipe = StableDiffusionControlNetPipeline.from_pretrained(root / "tiny-sd15", controlnet=controlnet)
        kwargs.update(image=control_image, controlnet_conditioning_scale=params.get("control_scale", 1.0))
    pipe.set_progress_bar_config(disable=True)
    if lora:
        pipe.load_lora_weights(str(root / LORAS[lora]), adapter_name=lora)
        pipe.set_adapters([lora], [params.get("lora_scale", 1.0)])
    return np.array(pipe(params["prompt"], **kwargs).images[0])


def run(runner: LocalRunner, spec: Any, params: dict[str, Any], control_image: Image.Image) -> np.ndarray:
    images = {"control": control_image} if "control_image" in params else None
    image = runner.run(spec, params, images=images, loras=LORAS)["image"]
    assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
    return image.numpy()


def request(**overrides: Any) -> dict[str, Any]:
    params = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        seed=7,
        width=64,
        height=64,
        num_inference_steps=3,
        guidance_scale=6.0,
    )
    params.update(overrides)
    return params


CASES = [
    pytest.param("tiny-sd15", request(), id="base"),
    pytest.param(
        "tiny-sd15", request(width=128, seed=0, guidance_scale=1.0, num_inference_steps=2), id="base-no-cfg"
    ),
    pytest.param(
        "tiny-sd15-controlnet", request(control_image="control", control_scale=0.7), id="controlnet"
    ),
    pytest.param(
        "tiny-sd15-controlnet",
        request(control_image="control", height=128, guidance_scale=1.0, seed=3),
        id="controlnet-no-cfg",
    ),
    pytest.param("tiny-sd15-lora", request(lora="style", lora_scale=0.8), id="lora"),
    pytest.param(
        "tiny-sd15-controlnet-lora",
        request(control_image="control", lora="style", lora_scale=1.3, num_inference_steps=4),
        id="controlnet-lora",
    ),
]


@pytest.mark.parametrize(("name", "params"), CASES)
def test_each_workflow_reproduces_its_monolithic_pipeline_bitwise(
    root: Path,
    specs: dict[str, Any],
    runner: LocalRunner,
    control_image: Image.Image,
    name: str,
    params: dict,
) -> None:
    image = run(runner, specs[name], params, control_image)
    expected = pipeline_image(
        root,
        params,
        control_image=control_image if "control_image" in params else None,
        lora=params.get("lora"),
    )

    assert image.shape == (params["height"], params["width"], 3)
    assert len(np.unique(image)) > 10, "a flat image would make the comparison meaningless"
    assert np.array_equal(image, expected)


def test_controlnet_and_lora_each_change_the_image(
    specs: dict[str, Any], runner: LocalRunner, control_image: Image.Image
) -> None:
    base = run(runner, specs["tiny-sd15"], request(), control_image)
    controlled = run(runner, specs["tiny-sd15-controlnet"], request(control_image="control"), control_image)
    styled = run(runner, specs["tiny-sd15-lora"], request(lora="style"), control_image)
    unstyled = run(runner, specs["tiny-sd15-lora"], request(), control_image)

    assert not np.array_equal(base, controlled)
    assert not np.array_equal(base, styled)
    assert np.array_equal(base, unstyled), "lora='' is the base model"


@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning")  # a 2nd adapter
def test_one_warm_runner_gives_a_lora_request_a_plain_request_and_another_lora_request_their_own_images(
    root: Path, specs: dict[str, Any], control_image: Image.Image
) -> None:
    warm = LocalRunner(root, classes=CLASSES)
    sequence = [
        request(lora="style", lora_scale=0.8),
        request(),
        request(lora="other", lora_scale=1.0),
        request(lora="style", lora_scale=0.5),
    ]

    images = [run(warm, specs["tiny-sd15-lora"], params, control_image) for params in sequence]

    for params, image in zip(sequence, images, strict=True):
        assert np.array_equal(image, pipeline_image(root, params, lora=params.get("lora")))
    assert len({image.tobytes() for image in images}) == len(images)
    switch = warm._components["sd.unet|tiny-sd15"]["lora"]
    assert len(switch.loaded) == 2, "each adapter file is loaded once and kept"


class RecordingUnet(sd.SdUnet):
    """sd.unet that logs when its first down block and mid block run and when each callback is fetched."""

    events: list[str] = []

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        unet = components["unet"]
        for name in ("down_block_res_samples", "mid_block_res_sample"):
            inner = inputs[name]
            assert isinstance(inner, Deferred) and not inner.fetched

            def fetch(inner: Deferred = inner, name: str = name) -> Any:
                self.events.append(f"fetch {name}")
                return inner()

            inputs[name] = Deferred(name, fetch)
        hooks = [
            unet.down_blocks[0].register_forward_hook(lambda *_: self.events.append("down_blocks[0] ran")),
            unet.mid_block.register_forward_hook(lambda *_: self.events.append("mid_block ran")),
        ]
        try:
            self.events.append("execute")
            return super().execute(components, **inputs)
        finally:
            for hook in hooks:
                hook.remove()


def test_the_controlnet_outputs_are_fetched_mid_forward_and_the_image_is_unchanged(
    root: Path, specs: dict[str, Any], control_image: Image.Image
) -> None:
    RecordingUnet.events = []
    recording = LocalRunner(root, classes={**CLASSES, "sd.unet": RecordingUnet})
    params = request(control_image="control", num_inference_steps=2)

    image = run(recording, specs["tiny-sd15-controlnet"], params, control_image)

    per_step = [
        "execute",
        "down_blocks[0] ran",
        "fetch down_block_res_samples",
        "mid_block ran",
        "fetch mid_block_res_sample",
    ]
    assert RecordingUnet.events == per_step * 2
    assert np.array_equal(image, pipeline_image(root, params, control_image=control_image))


def test_the_unet_rejects_a_lora_with_text_encoder_layers(root: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "with-text-encoder.safetensors"
    save_file(
        {
            "unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.zeros(4, 16),
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
        },
        str(path),
    )
    unet = sd.SdUnet()
    components = unet.load_model(str(root / "tiny-sd15"))
    latents = torch.zeros(1, 4, 8, 8)

    with pytest.raises(ValueError, match="text encoder are not supported"):
        unet.execute(
            components,
            latents=latents,
            timesteps=torch.tensor([1]),
            step=0,
            guidance_scale=1.0,
            prompt_embeds=torch.zeros(1, 77, 32),
            lora=str(path),
        )


def test_the_ddim_step_rejects_timesteps_of_another_schedule(root: Path) -> None:
    prepare, ddim = sd.SdPrepareLatents(), sd.SdDdimStep()
    prepared = prepare.execute(
        prepare.load_model(str(root / "tiny-sd15")), seed=0, height=64, width=64, num_inference_steps=4
    )
    latents = prepared["latents"]

    with pytest.raises(ValueError, match="3-step DDIM schedule"):
        ddim.execute(
            ddim.load_model(str(root / "tiny-sd15")),
            noise_pred=torch.zeros_like(latents),
            latents=latents,
            timesteps=prepared["timesteps"],
            step=0,
            num_inference_steps=3,
        )


def test_signatures_and_workflows_are_read_in_a_process_that_cannot_import_torch() -> None:
    code = (
        "import json, sys\n"
        "for name in ('torch', 'diffusers', 'transformers', 'numpy', 'peft'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        "from libs.models.sd_workflows import MODELFNS, workflows\n"
        "sigs = {c.fn_name: [c.signature().inputs, c.signature().outputs, c.signature().optional] for c in MODELFNS}\n"
        "print(json.dumps({'sigs': sigs, 'workflows': [w.name for w in workflows()]}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert {name: sig[:2] for name, sig in got["sigs"].items()} == {
        name: [inputs, outputs] for name, (inputs, outputs) in EXPECTED_IO.items()
    }
    assert got["sigs"]["sd.unet"][2] == [
        "down_block_res_samples",
        "mid_block_res_sample",
        "lora",
        "lora_scale",
    ]
    assert got["sigs"]["sd.text_encoder"][2] == ["negative_prompt"]
    assert got["workflows"] == [
        "tiny-sd15",
        "tiny-sd15-controlnet",
        "tiny-sd15-lora",
        "tiny-sd15-controlnet-lora",
    ]


def test_the_entry_points_name_each_class_by_its_fn_name() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="serverless_t2i.modelfns")}
    if "sd.unet" not in eps:
        pytest.skip("the sd.* entry points are not registered in this installation")

    for cls in MODELFNS:
        assert eps[cls.fn_name] == f"libs.models.sd:{cls.__name__}"


def test_build_is_idempotent_and_its_random_weights_are_not_zero_where_init_would_zero_them(
    root: Path,
) -> None:
    from diffusers import ControlNetModel
    from safetensors.torch import load_file

    manifests = [
        root / "tiny-sd15" / tiny_sd.MANIFEST,
        root / "tiny-sd15-controlnet" / tiny_sd.MANIFEST,
        tiny_sd.lora_manifest_path(root / STYLE),
    ]
    before = [m.stat().st_mtime_ns for m in manifests]

    built = tiny_sd.build(root)

    assert built == {
        "tiny-sd15": root / "tiny-sd15",
        "tiny-sd15-controlnet": root / "tiny-sd15-controlnet",
        "tiny-sd15-style": root / STYLE,
    }
    assert [m.stat().st_mtime_ns for m in manifests] == before
    assert tiny_sd.read_manifest(manifests[0]) == {"family": "sd15", "kind": "pipeline", "seed": 0}
    controlnet = ControlNetModel.from_pretrained(root / "tiny-sd15-controlnet")
    assert all(block.weight.abs().sum() > 0 for block in controlnet.controlnet_down_blocks)
    assert controlnet.controlnet_mid_block.weight.abs().sum() > 0
    lora = load_file(str(root / STYLE))
    lora_b = [v for k, v in lora.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)
    assert all(k.startswith("unet.") for k in lora)
