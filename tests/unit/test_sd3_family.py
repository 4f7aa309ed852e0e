"""The SD3 workflows, run node by node by LocalRunner, reproduce diffusers' SD3 pipelines bitwise.

References are the monolithic ``StableDiffusion3Pipeline`` / ``StableDiffusion3ControlNetPipeline``
loaded from the same folders, called with the same prompt, seed, size and steps, and (for LoRA) the same
adapter applied the pipeline's own way (``load_lora_weights`` + ``set_adapters``). The ControlNet
pipeline samples the control image's VAE latents from the *global* RNG; ``sd3.control_image`` draws them
from a private generator seeded with the request's seed, so references seed the global RNG with
``torch.manual_seed(seed)`` right before the call (see ``libs/models/sd3_controlnet.py``).
"""

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

from libs.models import sd3, tiny_sd3
from libs.models.sd3_workflows import MODELFNS, sd3_workflow, workflows
from libs.workflow.local import LocalRunner
from libs.workflow.modelfn import Deferred

REPO = Path(__file__).resolve().parents[2]
PROMPT = "A photo of a Cat holding a sign that says 'hello world', 4k!"
NEGATIVE = "blurry, low quality"
MAX_SEQ = 24
LORA_NAME = "style"
CLASSES = {cls.fn_name: cls for cls in MODELFNS}

EXPECTED_IO = {
    "sd3.clip_encoder": (
        {"prompt": False, "negative_prompt": False, "guidance_scale": False},
        ["clip_prompt_embeds", "pooled_prompt_embeds"],
        [],
    ),
    "sd3.t5_encoder": (
        {"prompt": False, "negative_prompt": False, "guidance_scale": False, "max_sequence_length": False},
        ["t5_prompt_embeds"],
        [],
    ),
    "sd3.join_prompt_embeds": (
        {"clip_prompt_embeds": False, "t5_prompt_embeds": False},
        ["prompt_embeds"],
        [],
    ),
    "sd3.prepare_latents": (
        {"seed": False, "height": False, "width": False, "num_inference_steps": False},
        ["latents", "timesteps"],
        [],
    ),
    "sd3.transformer": (
        {
            "latents": False,
            "timesteps": False,
            "step": False,
            "guidance_scale": False,
            "prompt_embeds": False,
            "pooled_prompt_embeds": False,
            "control_block_samples": True,
            "lora": False,
            "lora_scale": False,
        },
        ["noise_pred"],
        ["control_block_samples", "lora", "lora_scale"],
    ),
    "sd3.flow_match_step": (
        {
            "noise_pred": False,
            "latents": False,
            "timesteps": False,
            "step": False,
            "num_inference_steps": False,
        },
        ["latents"],
        [],
    ),
    "sd3.vae_decode": ({"latents": False}, ["image"], []),
    "sd3.control_image": (
        {
            "control_image": False,
            "height": False,
            "width": False,
            "seed": False,
            "guidance_scale": False,
            "force_zeros_for_pooled_projection": False,
        },
        ["control_latents"],
        [],
    ),
    "sd3.controlnet": (
        {
            "latents": False,
            "timesteps": False,
            "step": False,
            "guidance_scale": False,
            "prompt_embeds": False,
            "pooled_prompt_embeds": False,
            "control_latents": False,
            "control_scale": False,
            "control_guidance_start": False,
            "control_guidance_end": False,
            "force_zeros_for_pooled_projection": False,
        },
        ["control_block_samples"],
        ["control_guidance_start", "control_guidance_end", "force_zeros_for_pooled_projection"],
    ),
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
    tiny_sd3.build(out, seed=0)
    return out


@pytest.fixture(scope="module")
def paths(root: Path) -> dict[str, Path]:
    return tiny_sd3.build(root, seed=0)  # already built: returns the paths


@pytest.fixture(scope="module")
def loras(paths: dict[str, Path]) -> dict[str, str]:
    return {LORA_NAME: str(paths[tiny_sd3.LORA])}


@pytest.fixture(scope="module")
def runner(root: Path) -> LocalRunner:
    """One warm runner for the whole module: its instances serve every workflow and LoRA in turn."""
    return LocalRunner(root, classes=CLASSES)


@pytest.fixture(scope="module")
def control_image() -> Image.Image:
    # Not the output size: the pipeline's prepare_image resizes it, and so must sd3.control_image.
    rng = np.random.RandomState(0)
    ramp = np.linspace(0, 255, 96)[None, :, None] * np.ones((80, 96, 3))
    return Image.fromarray((0.5 * ramp + 0.5 * rng.rand(80, 96, 3) * 255).astype("uint8"))


def _pipeline(paths: dict[str, Path], controlnet: str | None = None, lora: bool = False) -> Any:
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline, StableDiffusion3Pipeline

    base = paths[tiny_sd3.BASE]
    if controlnet is None:
        pipe = StableDiffusion3Pipeline.from_pretrained(base)
    else:
        net = SD3ControlNetModel.from_pretrained(controlnet)
        pipe = StableDiffusion3ControlNetPipeline.from_pretrained(base, controlnet=net)
    pipe.set_progress_bar_config(disable=True)
    if lora:
        pipe.load_lora_weights(str(paths[tiny_sd3.LORA]), adapter_name=LORA_NAME)
    return pipe


@pytest.fixture(scope="module")
def pipes(paths: dict[str, Path]) -> dict[str, Any]:
    controlnet = str(paths[tiny_sd3.CONTROLNET])
    return {
        "tiny-sd3": _pipeline(paths),
        "tiny-sd3-lora": _pipeline(paths, lora=True),
        "tiny-sd3-controlnet": _pipeline(paths, controlnet=controlnet),
        "tiny-sd3-controlnet-lora": _pipeline(paths, controlnet=controlnet, lora=True),
    }


def reference(pipe: Any, params: dict[str, Any], control_image: Image.Image | None = None) -> torch.Tensor:
    """The monolithic pipeline's image for workflow ``params``, as a uint8 [H, W, 3] tensor."""
    kwargs: dict[str, Any] = {}
    if "control_image" in params:
        kwargs.update(
            control_image=control_image, controlnet_conditioning_scale=params.get("control_scale", 1.0)
        )
    if params.get("lora"):
        pipe.set_adapters([LORA_NAME], [params.get("lora_scale", 1.0)])
    seed = params.get("seed", 0)
    torch.manual_seed(seed)  # the ControlNet pipeline's control-latent sample uses the global RNG
    image = pipe(
        params["prompt"],
        negative_prompt=params.get("negative_prompt", ""),
        height=params["height"],
        width=params["width"],
        num_inference_steps=params["num_inference_steps"],
        guidance_scale=params.get("guidance_scale", 7.0),
        generator=torch.Generator().manual_seed(seed),
        max_sequence_length=MAX_SEQ,
        **kwargs,
    ).images[0]
    return torch.from_numpy(np.array(image))


def request(**changes: Any) -> dict[str, Any]:
    params = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        seed=0,
        height=64,
        width=64,
        num_inference_steps=3,
        guidance_scale=5.0,
        max_sequence_length=MAX_SEQ,
    )
    params.update(changes)
    return params


def run(runner: LocalRunner, name: str, params: dict[str, Any], **kwargs: Any) -> torch.Tensor:
    spec = {s.name: s for s in workflows()}[name]
    return runner.run(spec, params, **kwargs)["image"]


CASES = [
    pytest.param("tiny-sd3", {}, id="tiny-sd3-64x64-cfg"),
    pytest.param(
        "tiny-sd3",
        dict(height=128, width=64, num_inference_steps=2, seed=7, guidance_scale=1.0),
        id="tiny-sd3-128x64-no-cfg",
    ),
    pytest.param(
        "tiny-sd3-lora", dict(lora=LORA_NAME, lora_scale=0.75, seed=3), id="tiny-sd3-lora-scale-0.75"
    ),
    pytest.param(
        "tiny-sd3-controlnet",
        dict(control_image="ctl", control_scale=0.7, seed=11, height=64, width=128),
        id="tiny-sd3-controlnet-64x128",
    ),
    pytest.param(
        "tiny-sd3-controlnet-lora",
        dict(control_image="ctl", lora=LORA_NAME, seed=5, num_inference_steps=2),
        id="tiny-sd3-controlnet-lora",
    ),
]


@pytest.mark.parametrize(("name", "changes"), CASES)
def test_each_workflow_reproduces_its_monolithic_pipeline_bitwise(
    runner: LocalRunner,
    pipes: dict[str, Any],
    loras: dict[str, str],
    control_image: Image.Image,
    name: str,
    changes: dict[str, Any],
) -> None:
    params = request(**changes)
    image = run(runner, name, params, images={"ctl": control_image}, loras=loras)
    expected = reference(pipes[name], params, control_image)

    assert image.dtype == torch.uint8 and image.shape == (params["height"], params["width"], 3)
    assert image.unique().numel() > 10, "a flat image would make the comparison meaningless"
    assert torch.equal(image, expected)


def test_the_controlnet_and_the_lora_each_change_the_image(
    runner: LocalRunner, loras: dict[str, str], control_image: Image.Image
) -> None:
    base = run(runner, "tiny-sd3", request())
    with_lora = run(runner, "tiny-sd3-lora", request(lora=LORA_NAME), loras=loras)
    with_control = run(
        runner, "tiny-sd3-controlnet", request(control_image="ctl"), images={"ctl": control_image}
    )

    assert not torch.equal(base, with_lora)
    assert not torch.equal(base, with_control)


def test_a_warm_runner_switching_lora_then_none_then_lora_gives_each_request_its_own_image(
    runner: LocalRunner, pipes: dict[str, Any], loras: dict[str, str]
) -> None:
    requests = [
        request(lora=LORA_NAME, lora_scale=1.0, seed=1),
        request(lora="", seed=1),
        request(lora=LORA_NAME, lora_scale=0.5, seed=1),
    ]
    images = [run(runner, "tiny-sd3-lora", params, loras=loras) for params in requests]
    # ... and the workflow without LoRA parameters on the same warm transformer, after a LoRA request
    plain = run(runner, "tiny-sd3", request(seed=1))

    assert torch.equal(images[0], reference(pipes["tiny-sd3-lora"], requests[0]))
    assert torch.equal(images[1], reference(pipes["tiny-sd3"], requests[1]))
    assert torch.equal(images[2], reference(pipes["tiny-sd3-lora"], requests[2]))
    assert torch.equal(plain, images[1])
    assert not torch.equal(images[0], images[2])


def test_the_controlnet_output_is_fetched_mid_forward_after_the_first_transformer_block(
    root: Path, pipes: dict[str, Any], control_image: Image.Image
) -> None:
    events: list[str] = []

    class RecordingTransformer(sd3.SD3Transformer):
        def load_model(self, model_path: str) -> dict[str, Any]:
            components = super().load_model(model_path)
            block = components["transformer"].transformer_blocks[0]
            block.register_forward_hook(lambda *_: events.append("block 0 ran"))
            return components

        def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
            deferred = inputs["control_block_samples"]
            assert isinstance(deferred, Deferred) and not deferred.fetched
            events.append("forward starts")

            def fetch() -> Any:
                events.append("fetched")
                return deferred()

            out = super().execute(
                components, **{**inputs, "control_block_samples": Deferred(deferred.name, fetch)}
            )
            events.append("forward done")
            return out

    steps = 3
    params = request(control_image="ctl", num_inference_steps=steps, seed=2)
    fresh = LocalRunner(root, classes={**CLASSES, "sd3.transformer": RecordingTransformer})
    image = run(fresh, "tiny-sd3-controlnet", params, images={"ctl": control_image})

    assert events == ["forward starts", "block 0 ran", "fetched", "forward done"] * steps
    assert torch.equal(image, reference(pipes["tiny-sd3-controlnet"], params, control_image))


def test_a_controlnet_that_keeps_pooled_projections_and_the_vae_shift_matches_its_pipeline(
    root: Path, paths: dict[str, Path], control_image: Image.Image
) -> None:
    # The other branch of CN L1058-1062 / L1137-1141: pooled projections passed, VAE shift subtracted.
    folder = root / "tiny-sd3-controlnet-pooled"
    if not folder.exists():
        tiny_sd3.sd3_controlnet(
            seed=1, num_layers=1, force_zeros_for_pooled_projection=False
        ).save_pretrained(folder)
    spec = sd3_workflow(
        "tiny-sd3-controlnet-pooled",
        "tiny-sd3",
        sizes=["64x64"],
        controlnet="tiny-sd3-controlnet-pooled",
        force_zeros_for_pooled_projection=False,
        max_sequence_length=MAX_SEQ,
    )
    params = request(control_image="ctl", control_scale=1.3, seed=4)
    image = LocalRunner(root, classes=CLASSES).run(spec, params, images={"ctl": control_image})["image"]

    assert torch.equal(image, reference(_pipeline(paths, controlnet=str(folder)), params, control_image))


def test_a_workflow_whose_force_zeros_flag_contradicts_the_controlnet_config_is_refused(
    root: Path, control_image: Image.Image
) -> None:
    spec = sd3_workflow(
        "tiny-sd3-controlnet-wrong",
        "tiny-sd3",
        sizes=["64x64"],
        controlnet="tiny-sd3-controlnet",
        force_zeros_for_pooled_projection=False,  # the tiny ControlNet has True
    )

    with pytest.raises(ValueError, match="force_zeros_for_pooled_projection"):
        LocalRunner(root, classes=CLASSES).run(
            spec, request(control_image="ctl"), images={"ctl": control_image}
        )


def test_the_control_image_node_leaves_the_global_rng_alone(
    runner: LocalRunner, control_image: Image.Image
) -> None:
    params = request(control_image="ctl", num_inference_steps=1)
    run(runner, "tiny-sd3-controlnet", params, images={"ctl": control_image})  # warm: nothing left to load
    torch.manual_seed(12345)
    before = torch.random.get_rng_state()
    first = run(runner, "tiny-sd3-controlnet", params, images={"ctl": control_image})
    torch.manual_seed(999)  # another global state must not change the result
    second = run(runner, "tiny-sd3-controlnet", params, images={"ctl": control_image})

    torch.manual_seed(12345)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(first, second)


def test_the_scheduler_step_rejects_timesteps_of_another_schedule(root: Path) -> None:
    prepare, step = sd3.SD3PrepareLatents(), sd3.SD3FlowMatchStep()
    model = str(root / tiny_sd3.BASE)
    prepared = prepare.execute(prepare.load_model(model), seed=0, height=64, width=64, num_inference_steps=4)

    with pytest.raises(ValueError, match="3-step schedule"):
        step.execute(
            step.load_model(model),
            noise_pred=torch.zeros_like(prepared["latents"]),
            latents=prepared["latents"],
            timesteps=prepared["timesteps"],
            step=0,
            num_inference_steps=3,
        )


def test_a_lora_whose_metadata_sets_alpha_other_than_rank_is_refused() -> None:
    sd3._check_lora_metadata("ok.safetensors", {"transformer.r": 4, "transformer.lora_alpha": 4})

    with pytest.raises(ValueError, match="lora_alpha=8"):
        sd3._check_lora_metadata("x.safetensors", {"transformer.r": 4, "transformer.lora_alpha": 8})


def test_the_workflows_declare_the_platform_parameters() -> None:
    specs = {s.name: s for s in workflows()}

    assert sorted(specs) == ["tiny-sd3", "tiny-sd3-controlnet", "tiny-sd3-controlnet-lora", "tiny-sd3-lora"]
    base = {
        "prompt",
        "negative_prompt",
        "seed",
        "width",
        "height",
        "num_inference_steps",
        "guidance_scale",
        "max_sequence_length",
    }
    assert set(specs["tiny-sd3"].params) == base
    assert set(specs["tiny-sd3-lora"].params) == base | {"lora", "lora_scale"}
    assert set(specs["tiny-sd3-controlnet"].params) == base | {"control_image", "control_scale"}
    assert set(specs["tiny-sd3-controlnet-lora"].params) == base | {
        "control_image",
        "control_scale",
        "lora",
        "lora_scale",
    }
    params = specs["tiny-sd3-controlnet-lora"].params
    assert params["control_image"].type == "image" and params["control_image"].required
    assert params["lora"].type == "lora" and params["lora"].default == ""
    assert params["control_scale"].default == 1.0 and params["lora_scale"].default == 1.0
    assert params["negative_prompt"].default == "" and params["guidance_scale"].default == 7.0


def test_signatures_and_workflows_are_read_in_a_process_that_cannot_import_torch() -> None:
    code = (
        "import json, sys\n"
        "for name in ('torch', 'diffusers', 'transformers', 'numpy', 'PIL', 'peft'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        "from libs.models.sd3_workflows import MODELFNS, workflows\n"
        "sigs = {c.fn_name: [c.signature().inputs, c.signature().outputs, c.signature().optional] for c in MODELFNS}\n"
        "print(json.dumps({'sigs': sigs, 'workflows': [w.name for w in workflows()]}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["sigs"] == {name: list(io) for name, io in EXPECTED_IO.items()}
    assert len(got["workflows"]) == 4


def test_the_entry_points_name_each_class_by_its_fn_name() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="serverless_t2i.modelfns")}
    if "sd3.transformer" not in eps:
        pytest.skip("the sd3 entry points are not registered in this installation")

    controlnet_fns = {"sd3.control_image", "sd3.controlnet"}  # in libs.models.sd3_controlnet
    for cls in MODELFNS:
        module = "libs.models.sd3_controlnet" if cls.fn_name in controlnet_fns else "libs.models.sd3"
        assert eps[cls.fn_name] == f"{module}:{cls.__name__}"


def test_build_is_idempotent_and_leaves_complete_artifacts(root: Path, paths: dict[str, Path]) -> None:
    from diffusers import SD3ControlNetModel

    manifests = [
        paths[tiny_sd3.BASE] / tiny_sd3.MANIFEST,
        paths[tiny_sd3.CONTROLNET] / tiny_sd3.MANIFEST,
        tiny_sd3.lora_manifest_path(paths[tiny_sd3.LORA]),
    ]
    before = [m.stat().st_mtime_ns for m in manifests]

    assert tiny_sd3.build(root, seed=0) == paths
    assert [m.stat().st_mtime_ns for m in manifests] == before
    assert [tiny_sd3.read_manifest(m)["kind"] for m in manifests] == ["pipeline", "controlnet", "lora"]  # type: ignore[index]
    assert (
        SD3ControlNetModel.load_config(paths[tiny_sd3.CONTROLNET])["force_zeros_for_pooled_projection"]
        is True
    )
    assert not any(p.name.startswith(".") for p in root.iterdir()), "no temporary build folder is left"
