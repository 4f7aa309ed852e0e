"""The Sana ModelFns, run as workflows by the LocalRunner, reproduce diffusers' SanaPipeline and
SanaControlNetPipeline bitwise (tiny random models built from configs, no hub)."""

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

from libs.models import sana, sana_controlnet, sana_workflows
from libs.models.tiny_sana import MANIFEST, build, gemma_tokenizer, is_built
from libs.workflow.local import LocalRunner
from libs.workflow.modelfn import Deferred

# diffusers' DPM-Solver builds its sigmas with np.array(tensor, copy=False) (numpy 2 warns).
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

REPO = Path(__file__).resolve().parents[2]
PROMPT = "A photo of a Cat holding a sign that says 'hello world', 4k!"
STEPS = 3
MAX_SEQ = 24
LORA = "style"
CLASSES = {cls.fn_name: cls for cls in sana_workflows.MODELFNS}

EXPECTED_IO = {
    "sana.text_encoder": (
        {
            "prompt": False,
            "negative_prompt": False,
            "guidance_scale": False,
            "max_sequence_length": False,
            "complex_human_instruction": False,
        },
        ["prompt_embeds", "prompt_attention_mask"],
        [],
    ),
    "sana.prepare_latents": (
        {
            "seed": False,
            "height": False,
            "width": False,
            "num_inference_steps": False,
            "use_resolution_binning": False,
        },
        ["latents", "timesteps", "solver_history"],
        [],
    ),
    "sana.control_encode": (
        {
            "control_image": False,
            "height": False,
            "width": False,
            "use_resolution_binning": False,
            "guidance_scale": False,
        },
        ["control_latents"],
        [],
    ),
    "sana.controlnet": (
        {
            "latents": False,
            "timesteps": False,
            "step": False,
            "guidance_scale": False,
            "prompt_embeds": False,
            "prompt_attention_mask": False,
            "control_latents": False,
            "control_scale": False,
        },
        ["controlnet_block_samples"],
        [],
    ),
    "sana.transformer": (
        {
            "latents": False,
            "timesteps": False,
            "step": False,
            "guidance_scale": False,
            "prompt_embeds": False,
            "prompt_attention_mask": False,
            "controlnet_block_samples": True,
            "lora": False,
            "lora_scale": False,
        },
        ["noise_pred"],
        ["controlnet_block_samples", "lora", "lora_scale"],
    ),
    "sana.scheduler_step": (
        {
            "noise_pred": False,
            "latents": False,
            "timesteps": False,
            "step": False,
            "num_inference_steps": False,
            "solver_history": False,
        },
        ["latents", "solver_history"],
        [],
    ),
    "sana.vae_decode": (
        {"latents": False, "height": False, "width": False, "use_resolution_binning": False},
        ["image"],
        [],
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
    build(out)
    return out


@pytest.fixture(scope="module")
def paths(root: Path) -> dict[str, Path]:
    return build(root)  # already built: returns the paths without rebuilding


def _pipeline(cls_name: str, path: Path, lora: Path | None = None) -> Any:
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora), adapter_name=LORA)
    return pipe


@pytest.fixture(scope="module")
def pipes(paths: dict[str, Path]) -> dict[str, Any]:
    """The monolithic pipelines each workflow must match, LoRA loaded the pipeline's way."""
    lora = paths["tiny-sana-style"]
    return {
        "tiny-sana": _pipeline("SanaPipeline", paths["tiny-sana"]),
        "tiny-sana-controlnet": _pipeline("SanaControlNetPipeline", paths["tiny-sana-controlnet"]),
        "tiny-sana-lora": _pipeline("SanaPipeline", paths["tiny-sana"], lora),
        "tiny-sana-controlnet-lora": _pipeline("SanaControlNetPipeline", paths["tiny-sana-controlnet"], lora),
    }


@pytest.fixture(scope="module")
def runner(root: Path) -> LocalRunner:
    return LocalRunner(root, classes=CLASSES)


@pytest.fixture(scope="module")
def specs() -> dict[str, Any]:
    return {spec.name: spec for spec in sana_workflows.workflows()}


@pytest.fixture(scope="module")
def control_image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8), mode="RGB")


def pipeline_image(pipe: Any, control: Image.Image | None = None, **params: Any) -> np.ndarray:
    """The pipeline's PIL image as an array, called with the workflow parameters ``params``."""
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


def workflow_image(
    runner: LocalRunner, spec: Any, paths: dict[str, Path], control: Image.Image | None = None, **params: Any
) -> np.ndarray:
    images = {}
    if control is not None:
        params["control_image"] = "control"
        images["control"] = control
    out = runner.run(spec, params, images=images, loras={LORA: str(paths["tiny-sana-style"])})
    image = out["image"]
    assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
    return image.numpy()


BASE = dict(prompt=PROMPT, num_inference_steps=STEPS, max_sequence_length=MAX_SEQ)
CASES = [
    pytest.param(dict(height=512, width=512, seed=0), id="512x512-a-bin-size"),
    pytest.param(dict(height=500, width=500, seed=7), id="500x500-binned-then-resized-back"),
    pytest.param(dict(height=64, width=96, seed=3, use_resolution_binning=False), id="64x96-no-binning"),
    pytest.param(dict(height=384, width=672, seed=1, guidance_scale=1.0), id="no-guidance"),
    pytest.param(
        dict(
            height=448,
            width=576,
            seed=2,
            complex_human_instruction=False,
            negative_prompt="blurry, low quality",
        ),
        id="no-instruction-with-negative-prompt",
    ),
]
WORKFLOWS = ["tiny-sana", "tiny-sana-controlnet", "tiny-sana-lora", "tiny-sana-controlnet-lora"]


@pytest.mark.parametrize("name", WORKFLOWS)
@pytest.mark.parametrize("case", CASES)
def test_each_workflow_run_node_by_node_equals_the_monolithic_pipeline_bitwise(
    name: str,
    case: dict[str, Any],
    runner: LocalRunner,
    specs: dict[str, Any],
    pipes: dict[str, Any],
    paths: dict[str, Path],
    control_image: Image.Image,
) -> None:
    params = {**BASE, **case}
    if "lora" in name:
        params.update(lora=LORA, lora_scale=0.7)
    if "controlnet" in name:
        params["control_scale"] = 0.8
    control = control_image if "controlnet" in name else None

    got = workflow_image(runner, specs[name], paths, control, **params)
    expected = pipeline_image(pipes[name], control, **params)

    assert got.shape == (params["height"], params["width"], 3)
    assert np.unique(got).size > 10, "a flat image would make the comparison meaningless"
    assert np.array_equal(got, expected)


def test_the_controlnet_and_the_lora_each_change_the_image(
    runner: LocalRunner, specs: dict[str, Any], paths: dict[str, Path], control_image: Image.Image
) -> None:
    params = {**BASE, "height": 512, "width": 512}
    plain = workflow_image(runner, specs["tiny-sana"], paths, **params)
    controlled = workflow_image(runner, specs["tiny-sana-controlnet"], paths, control_image, **params)
    styled = workflow_image(runner, specs["tiny-sana-lora"], paths, lora=LORA, **params)

    assert not np.array_equal(plain, controlled)
    assert not np.array_equal(plain, styled)


def test_a_warm_runner_switching_lora_then_none_then_lora_gives_each_request_its_own_image(
    root: Path, specs: dict[str, Any], pipes: dict[str, Any], paths: dict[str, Path]
) -> None:
    warm = LocalRunner(root, classes=CLASSES)
    spec = specs["tiny-sana-lora"]
    params = {**BASE, "height": 384, "width": 672, "seed": 11}
    styled_expected = pipeline_image(pipes["tiny-sana-lora"], lora=LORA, lora_scale=0.5, **params)
    plain_expected = pipeline_image(pipes["tiny-sana"], **params)

    first = workflow_image(warm, spec, paths, lora=LORA, lora_scale=0.5, **params)
    none = workflow_image(warm, spec, paths, lora="", **params)
    again = workflow_image(warm, spec, paths, lora=LORA, lora_scale=0.5, **params)

    assert np.array_equal(first, styled_expected)
    assert np.array_equal(none, plain_expected)
    assert np.array_equal(again, styled_expected)
    assert not np.array_equal(first, none)


def test_the_transformer_fetches_the_controlnet_samples_inside_its_forward_and_the_image_is_identical(
    root: Path,
    specs: dict[str, Any],
    pipes: dict[str, Any],
    paths: dict[str, Path],
    control_image: Image.Image,
) -> None:
    events: list[str] = []

    class RecordingTransformer(sana.SanaTransformer):
        def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
            deferred = inputs["controlnet_block_samples"]
            assert isinstance(deferred, Deferred) and not deferred.fetched

            def fetch() -> Any:
                events.append("fetch")
                return deferred()

            inputs["controlnet_block_samples"] = Deferred(deferred.name, fetch)
            events.append("execute")
            out = super().execute(components, **inputs)
            events.append("done")
            return out

    recording = LocalRunner(root, classes={**CLASSES, "sana.transformer": RecordingTransformer})
    params = {**BASE, "height": 512, "width": 512, "seed": 4}
    expected = pipeline_image(pipes["tiny-sana-controlnet"], control_image, **params)

    # Load the components first, then hook the blocks of the very transformer the runner uses.
    workflow_image(recording, specs["tiny-sana-controlnet"], paths, control_image, **params)
    transformer = recording._components["sana.transformer|tiny-sana-controlnet"]["transformer"]
    blocks = transformer.transformer_blocks
    for i, block in enumerate(blocks):
        block.register_forward_hook(lambda *_, i=i: events.append(f"block{i}"))
    events.clear()
    got = workflow_image(recording, specs["tiny-sana-controlnet"], paths, control_image, **params)

    # Sana adds sample i-1 after block i (i >= 1): the first touch of the list comes after block 1.
    per_step = ["execute", "block0", "block1", "fetch", *[f"block{i}" for i in range(2, len(blocks))], "done"]
    assert events == per_step * STEPS
    assert np.array_equal(got, expected)


@pytest.mark.parametrize(
    "scheduler_kwargs",
    [
        pytest.param(dict(solver_order=2), id="order2-like-released-sana"),
        pytest.param(dict(solver_order=3, lower_order_final=False), id="order3"),
    ],
)
def test_a_multistep_dpm_solver_carries_its_history_between_nodes_and_stays_bitwise_equal(
    scheduler_kwargs: dict[str, Any], paths: dict[str, Path], tmp_path: Path
) -> None:
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline

    # Released Sana checkpoints ship this scheduler (flow prediction, flow sigmas, DPM-Solver++).
    pipe = SanaPipeline.from_pretrained(paths["tiny-sana"])
    pipe.scheduler = DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++",
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        **scheduler_kwargs,
    )
    pipe.set_progress_bar_config(disable=True)
    model = tmp_path / "tiny-sana-dpm"
    pipe.save_pretrained(model)
    params = {**BASE, "num_inference_steps": 5, "height": 512, "width": 512, "seed": 9}

    got = workflow_image(
        LocalRunner(tmp_path, classes=CLASSES), sana_workflows.tiny_sana(str(model)), paths, **params
    )

    assert np.array_equal(got, pipeline_image(pipe, **params))


def test_a_controlnet_saved_on_its_own_loads_like_the_one_in_the_pipeline_folder(
    paths: dict[str, Path], pipes: dict[str, Any], tmp_path: Path
) -> None:
    pipes["tiny-sana-controlnet"].controlnet.save_pretrained(tmp_path / "controlnet")
    node = sana_controlnet.SanaControlNet()
    alone = node.load_model(str(tmp_path / "controlnet"))["controlnet"].state_dict()
    in_folder = node.load_model(str(paths["tiny-sana-controlnet"]))["controlnet"].state_dict()

    assert alone.keys() == in_folder.keys()
    assert all(torch.equal(alone[k], in_folder[k]) for k in alone)
    spec = sana_workflows.sana_workflow(
        "x", "tiny-sana", sizes=["512x512"], controlnet=True, controlnet_model="sana-controlnet"
    )
    assert {op.id: op.model for op in spec.body[-2].body} == {
        "controlnet": "sana-controlnet",
        "transformer": "tiny-sana",
        "scheduler": "tiny-sana",
    }


def test_the_scheduler_step_refuses_another_schedule_or_a_wrong_history(paths: dict[str, Path]) -> None:
    prepare, step = sana.SanaPrepareLatents(), sana.SanaSchedulerStep()
    model = str(paths["tiny-sana"])
    init = prepare.execute(
        prepare.load_model(model),
        seed=0,
        height=64,
        width=64,
        num_inference_steps=4,
        use_resolution_binning=False,
    )
    components = step.load_model(model)
    latents = init["latents"]
    inputs = dict(noise_pred=torch.zeros_like(latents), latents=latents, timesteps=init["timesteps"], step=0)

    assert init["solver_history"].shape == (0, *latents.shape)
    with pytest.raises(ValueError, match="3-step schedule"):
        step.execute(components, **inputs, num_inference_steps=3, solver_history=init["solver_history"])
    with pytest.raises(ValueError, match="solver_history"):
        step.execute(components, **inputs, num_inference_steps=4, solver_history=latents[None])


def test_the_text_encoder_matches_encode_prompt_with_the_instruction_and_the_select_index(
    paths: dict[str, Path], pipes: dict[str, Any]
) -> None:
    node = sana.SanaTextEncoder()
    components = node.load_model(str(paths["tiny-sana"]))
    out = node.execute(
        components,
        prompt=PROMPT,
        negative_prompt="ugly",
        guidance_scale=4.5,
        max_sequence_length=MAX_SEQ,
        complex_human_instruction=True,
    )
    pipe = pipes["tiny-sana"]
    chi = components["complex_human_instruction"]
    with torch.no_grad():  # as in SanaPipeline.__call__; grad mode changes the bits
        embeds, mask, neg_embeds, neg_mask = pipe.encode_prompt(
            PROMPT, True, negative_prompt="ugly", max_sequence_length=MAX_SEQ, complex_human_instruction=chi
        )

    assert len(chi) > 1 and chi[-1].startswith("User Prompt")
    assert out["prompt_embeds"].shape == (2, MAX_SEQ, 16)
    assert torch.equal(out["prompt_embeds"], torch.cat([neg_embeds, embeds]))
    assert torch.equal(out["prompt_attention_mask"], torch.cat([neg_mask, mask]))
    assert out["prompt_attention_mask"][1, 0] == 1  # select_index keeps the <bos>


def test_the_gemma_tokenizer_reloads_from_the_saved_folder_with_identical_ids(paths: dict[str, Path]) -> None:
    from transformers import GemmaTokenizer, GemmaTokenizerFast

    built = gemma_tokenizer()
    loaded = GemmaTokenizer.from_pretrained(paths["tiny-sana"], subfolder="tokenizer")
    for prompt in [PROMPT, "a cat", "line one\nline two ~é~ 123"]:
        ids = built(prompt).input_ids
        assert loaded(prompt).input_ids == ids
        assert ids[0] == built.bos_token_id == 2
        assert built.unk_token_id not in ids, "the byte fallback covers every character"
    fast = GemmaTokenizerFast.from_pretrained(paths["tiny-sana"], subfolder="tokenizer")
    assert fast(PROMPT).input_ids == built(PROMPT).input_ids


def test_build_is_idempotent_and_writes_the_manifests_last(root: Path, paths: dict[str, Path]) -> None:
    manifest = root / "tiny-sana" / MANIFEST
    before = manifest.stat().st_mtime_ns
    lora_before = paths["tiny-sana-style"].stat().st_mtime_ns

    assert build(root) == paths
    assert is_built(root)
    assert manifest.stat().st_mtime_ns == before
    assert paths["tiny-sana-style"].stat().st_mtime_ns == lora_before
    assert paths["tiny-sana-style"] == root / "loras" / "tiny-sana-style.safetensors"
    assert (root / "tiny-sana-controlnet" / "controlnet" / "config.json").is_file()
    assert not is_built(root, seed=1)


def test_signatures_and_workflows_are_read_in_a_process_that_cannot_import_torch() -> None:
    code = (
        "import json, sys\n"
        "for name in ('torch', 'diffusers', 'transformers', 'numpy', 'peft', 'PIL'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        "from libs.models import sana_workflows\n"
        "sigs = {c.fn_name: c.signature() for c in sana_workflows.MODELFNS}\n"
        "names = [w.name for w in sana_workflows.workflows()]\n"
        "print(json.dumps({'names': names,\n"
        "                  'sigs': {n: [s.inputs, s.outputs, s.optional] for n, s in sigs.items()}}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["names"] == WORKFLOWS
    assert got["sigs"] == {name: [i, o, opt] for name, (i, o, opt) in EXPECTED_IO.items()}


def test_the_entry_points_name_each_class_by_its_fn_name() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="serverless_t2i.modelfns")}
    if not any(name.startswith("sana.") for name in eps):
        pytest.skip("the sana ModelFns are not registered as entry points in this installation")

    controlnet_fns = {"sana.control_encode", "sana.controlnet"}  # in libs.models.sana_controlnet
    for cls in sana_workflows.MODELFNS:
        module = "libs.models.sana_controlnet" if cls.fn_name in controlnet_fns else "libs.models.sana"
        assert eps[cls.fn_name] == f"{module}:{cls.__name__}"
