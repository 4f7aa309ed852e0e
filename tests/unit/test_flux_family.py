"""The Flux family's workflows (dev/schnell, ControlNet, LoRA, parallel true CFG), run node by node
through LocalRunner, reproduce their monolithic diffusers pipelines bitwise (tiny random models)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from libs.models import flux, flux_controlnet
from libs.models.tiny import LORA_NAME, build, lora_manifest_path, read_manifest
from libs.models.workflows import MODELFNS, flux_workflows, tiny_flux
from libs.workflow.local import LocalRunner
from libs.workflow.modelfn import Deferred
from libs.workflow.spec import WorkflowSpec

REPO = Path(__file__).resolve().parents[2]
PROMPT = "A photo of a Cat holding a sign that says 'hello world', 4k!"
NEGATIVE = "blurry, low quality"
DECODED: list[torch.Tensor] = []  # the latents every flux.vae_decode of this module received


class RecordingVaeDecode(flux.FluxVaeDecode):
    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        DECODED.append(inputs["latents"])
        return super().execute(components, **inputs)


CLASSES = {**{cls.fn_name: cls for cls in MODELFNS}, "flux.vae_decode": RecordingVaeDecode}
LORA = "style"  # the name requests use; LocalRunner maps it to the file

# name -> (checkpoint folder, ControlNet?, LoRA?)
FAMILY = {
    "tiny-flux": ("tiny-flux", False, False),
    "tiny-flux-controlnet": ("tiny-flux", True, False),
    "tiny-flux-lora": ("tiny-flux", False, True),
    "tiny-flux-controlnet-lora": ("tiny-flux", True, True),
    "tiny-flux-schnell": ("tiny-flux-schnell", False, False),
    "tiny-flux-schnell-controlnet": ("tiny-flux-schnell", True, False),
    "tiny-flux-schnell-lora": ("tiny-flux-schnell", False, True),
    "tiny-flux-schnell-controlnet-lora": ("tiny-flux-schnell", True, True),
}

EXPECTED_IO = {
    "flux.clip_encoder": ({"prompt": False}, ["pooled_prompt_embeds"], []),
    "flux.t5_encoder": ({"prompt": False, "max_sequence_length": False}, ["prompt_embeds", "text_ids"], []),
    "flux.control_encoder": (
        {"control_image": False, "height": False, "width": False, "seed": False},
        ["controlnet_cond", "generator_state"],
        [],
    ),
    "flux.prepare_latents": (
        {
            "seed": False,
            "height": False,
            "width": False,
            "num_inference_steps": False,
            "generator_state": False,
        },
        ["latents", "latent_image_ids", "timesteps"],
        ["generator_state"],
    ),
    "flux.controlnet": (
        {
            "latents": False,
            "timesteps": False,
            "step": False,
            "guidance_scale": False,
            "controlnet_cond": False,
            "control_scale": False,
            "prompt_embeds": False,
            "pooled_prompt_embeds": False,
            "text_ids": False,
            "latent_image_ids": False,
        },
        ["controlnet_block_samples", "controlnet_single_block_samples"],
        [],
    ),
    "flux.transformer": (
        {
            "latents": False,
            "timesteps": False,
            "step": False,
            "guidance_scale": False,
            "prompt_embeds": False,
            "pooled_prompt_embeds": False,
            "text_ids": False,
            "latent_image_ids": False,
            "controlnet_block_samples": True,
            "controlnet_single_block_samples": True,
            "lora": False,
            "lora_scale": False,
        },
        ["noise_pred"],
        ["controlnet_block_samples", "controlnet_single_block_samples", "lora", "lora_scale"],
    ),
    "flux.true_cfg": (
        {"noise_pred": False, "neg_noise_pred": False, "true_cfg_scale": False},
        ["noise_pred"],
        [],
    ),
    "flux.flow_match_step": (
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
    "flux.vae_decode": ({"latents": False, "height": False, "width": False}, ["image"], []),
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # The thread count changes the bits (NOTES-diffusers.md): pin it for pipelines and nodes alike.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def root(models: dict[str, Path]) -> Path:
    return models["tiny-flux"].parent


@pytest.fixture(scope="module")
def specs() -> dict[str, WorkflowSpec]:
    return {spec.name: spec for spec in flux_workflows()}


@pytest.fixture(scope="module")
def runner(root: Path) -> LocalRunner:
    """One warm runner for the module, as one set of executors serves many requests."""
    return LocalRunner(root, classes=CLASSES)


@pytest.fixture(scope="module")
def control_image() -> Image.Image:
    # Not the output size: the pipeline (and flux.control_encoder) resize it.
    pixels = np.random.default_rng(7).integers(0, 256, (80, 72, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


@dataclass(frozen=True, eq=False)
class Result:
    image: np.ndarray  # uint8 [H, W, 3]
    latents: torch.Tensor  # the final packed latents, before the VAE: compared too, as uint8
    # rounding can hide a difference of a few ulps

    def same(self, other: Result) -> bool:
        return np.array_equal(self.image, other.image) and torch.equal(self.latents, other.latents)


class Pipes:
    """Monolithic pipelines over the same folders, one per (checkpoint, ControlNet?, LoRA?)."""

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
                pipe.load_lora_weights(str(self.models[LORA_NAME]), adapter_name=LORA)
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
            pipe.set_adapters([LORA], [lora_scale])  # what LoraSwitch does on the transformer
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


@pytest.fixture(scope="module")
def pipes(models: dict[str, Path]) -> Pipes:
    return Pipes(models)


def resolved(spec: WorkflowSpec, given: dict[str, Any]) -> dict[str, Any]:
    """The request's parameters with the spec's defaults filled in (what the pipeline must get)."""
    out = {name: p.default for name, p in spec.params.items() if p.default is not None}
    out.update(given)
    return out


def run(
    runner: LocalRunner,
    spec: WorkflowSpec,
    params: dict[str, Any],
    models: dict[str, Path],
    **images: Image.Image,
) -> Result:
    out = runner.run(spec, params, images=images, loras={LORA: str(models[LORA_NAME])})
    image = out["image"]
    assert image.dtype == torch.uint8 and image.shape == (params["height"], params["width"], 3)
    return Result(image.numpy(), DECODED[-1])


def request(name: str, **more: Any) -> dict[str, Any]:
    """A request: 64x96 (not square), seed 11; dev with 3 steps, schnell with its defaults."""
    params: dict[str, Any] = dict(prompt=PROMPT, height=64, width=96, seed=11, max_sequence_length=32)
    if "schnell" not in name:
        params.update(num_inference_steps=3, guidance_scale=3.5)
    if "controlnet" in name:
        params.update(control_image="edges", control_scale=0.7)
    if "lora" in name:
        params.update(lora=LORA, lora_scale=0.8)
    params.update(more)
    return params


@pytest.mark.parametrize("name", list(FAMILY))
def test_each_family_workflow_reproduces_its_monolithic_pipeline_bitwise(
    name: str,
    runner: LocalRunner,
    pipes: Pipes,
    specs: dict[str, WorkflowSpec],
    models: dict[str, Path],
    control_image: Image.Image,
) -> None:
    model, controlnet, lora = FAMILY[name]
    spec = specs[name]
    given = request(name)
    params = resolved(spec, given)

    image = run(runner, spec, given, models, edges=control_image)
    expected = pipes.image(
        model,
        params,
        control_image=control_image if controlnet else None,
        lora_scale=params["lora_scale"] if lora else None,
    )

    assert np.unique(image.image).size > 10, "a flat image would make the comparison meaningless"
    assert image.same(expected)


def test_schnell_workflows_default_to_four_steps_and_no_guidance_and_the_transformer_embeds_none(
    specs: dict[str, WorkflowSpec], models: dict[str, Path]
) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    for name in ("tiny-flux-schnell", "tiny-flux-schnell-controlnet-lora"):
        assert specs[name].params["num_inference_steps"].default == 4
        assert specs[name].params["guidance_scale"].default == 0.0
    assert not FluxTransformer2DModel.load_config(models["tiny-flux-schnell"], subfolder="transformer")[
        "guidance_embeds"
    ]
    scheduler = FlowMatchEulerDiscreteScheduler.load_config(
        models["tiny-flux-schnell"], subfolder="scheduler"
    )
    assert scheduler["use_dynamic_shifting"] is False and scheduler["shift"] == 1.0


def test_parallel_true_cfg_reproduces_the_pipelines_negative_prompt_bitwise(
    runner: LocalRunner, pipes: Pipes, specs: dict[str, WorkflowSpec], models: dict[str, Path]
) -> None:
    spec = specs["tiny-flux-cfg-parallel"]
    given = request(spec.name, negative_prompt=NEGATIVE, true_cfg_scale=2.5)
    params = resolved(spec, given)

    image = run(runner, spec, given, models)
    expected = pipes.image("tiny-flux", params, negative_prompt=NEGATIVE, true_cfg_scale=2.5)
    without_cfg = pipes.image("tiny-flux", params)

    assert image.same(expected)
    assert not np.array_equal(image.image, without_cfg.image), "the negative branch must matter"
    nodes = [op.id for op in spec.body[-2].body]  # the denoising loop's body
    assert nodes == ["transformer", "transformer_neg", "cfg", "euler"]


def test_parallel_true_cfg_with_the_default_negative_prompt_and_scale_one_matches_the_pipeline(
    runner: LocalRunner, pipes: Pipes, specs: dict[str, WorkflowSpec], models: dict[str, Path]
) -> None:
    spec = specs["tiny-flux-cfg-parallel"]
    default_scale = request(spec.name)  # negative_prompt "" still counts as a negative prompt
    scale_one = request(spec.name, negative_prompt=NEGATIVE, true_cfg_scale=1.0)  # do_true_cfg is false

    image = run(runner, spec, default_scale, models)
    expected = pipes.image(
        "tiny-flux",
        resolved(spec, default_scale),
        negative_prompt="",
        true_cfg_scale=spec.params["true_cfg_scale"].default,
    )
    assert image.same(expected)
    image = run(runner, spec, scale_one, models)
    assert image.same(pipes.image("tiny-flux", resolved(spec, scale_one), negative_prompt=NEGATIVE))


def test_the_control_image_the_control_scale_and_the_lora_each_change_the_image(
    runner: LocalRunner, specs: dict[str, WorkflowSpec], models: dict[str, Path], control_image: Image.Image
) -> None:
    base = run(runner, specs["tiny-flux"], request("tiny-flux"), models)
    controlled = run(
        runner, specs["tiny-flux-controlnet"], request("tiny-flux-controlnet"), models, edges=control_image
    )
    weaker = run(
        runner,
        specs["tiny-flux-controlnet"],
        request("tiny-flux-controlnet", control_scale=0.2),
        models,
        edges=control_image,
    )
    other_image = Image.fromarray(255 - np.array(control_image), "RGB")
    other = run(
        runner, specs["tiny-flux-controlnet"], request("tiny-flux-controlnet"), models, edges=other_image
    )
    styled = run(runner, specs["tiny-flux-lora"], request("tiny-flux-lora"), models)

    images = [base, controlled, weaker, other, styled]
    for i, a in enumerate(images):
        for b in images[i + 1 :]:
            assert not np.array_equal(a.image, b.image)


def test_one_warm_transformer_switches_lora_per_request_and_never_fuses(
    root: Path, pipes: Pipes, specs: dict[str, WorkflowSpec], models: dict[str, Path]
) -> None:
    kept: list[dict[str, Any]] = []

    class KeptTransformer(flux.FluxTransformer):
        def load_model(self, model_path: str) -> dict[str, Any]:
            kept.append(super().load_model(model_path))
            return kept[-1]

    runner = LocalRunner(root, classes={**CLASSES, "flux.transformer": KeptTransformer})
    spec = specs["tiny-flux-lora"]
    plain = request(spec.name, lora="")
    styled = request(spec.name, lora_scale=1.0)
    half = request(spec.name, lora_scale=0.5)
    expected_styled = pipes.image("tiny-flux", resolved(spec, styled), lora_scale=1.0)
    expected_half = pipes.image("tiny-flux", resolved(spec, half), lora_scale=0.5)
    expected_plain = pipes.image("tiny-flux", resolved(spec, plain))  # a pipeline that never saw the LoRA

    sequence = [
        (styled, expected_styled),
        (plain, expected_plain),
        (styled, expected_styled),
        (half, expected_half),
    ]
    sequence += [(plain, expected_plain)]
    for given, expected in sequence:
        assert run(runner, spec, given, models).same(expected)

    (components,) = kept  # one warm transformer served every request
    assert len(components["lora"].loaded) == 1, "the adapter is loaded once and kept"
    transformer = components["transformer"]
    assert transformer.peft_config  # the adapter lives in separate PEFT layers
    # The file's adapter metadata (alpha 8, rank 4) was honoured: scaling = scale * 8 / 4.
    layer = transformer.transformer_blocks[0].attn.to_q
    assert layer.scaling[components["lora"].loaded[0]] == 0.5 * 2
    # Never fused: every base weight equals the file's.
    from diffusers import FluxTransformer2DModel

    fresh = FluxTransformer2DModel.from_pretrained(models["tiny-flux"], subfolder="transformer").state_dict()
    current = {
        k.replace(".base_layer", ""): v for k, v in transformer.state_dict().items() if "lora_" not in k
    }
    assert set(current) == set(fresh)
    assert all(torch.equal(current[k], fresh[k]) for k in fresh)


def test_the_transformer_fetches_controlnet_residuals_inside_its_forward_after_the_first_block(
    root: Path,
    pipes: Pipes,
    specs: dict[str, WorkflowSpec],
    models: dict[str, Path],
    control_image: Image.Image,
) -> None:
    events: list[str] = []

    class RecordingTransformer(flux.FluxTransformer):
        def load_model(self, model_path: str) -> dict[str, Any]:
            components = super().load_model(model_path)
            transformer = components["transformer"]
            transformer.transformer_blocks[0].register_forward_hook(
                lambda *_: events.append("double block 0")
            )
            transformer.single_transformer_blocks[0].register_forward_hook(
                lambda *_: events.append("single block 0")
            )
            return components

        def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
            for name in ("controlnet_block_samples", "controlnet_single_block_samples"):
                deferred = inputs[name]
                assert isinstance(deferred, Deferred) and not deferred.fetched

                def fetch(d: Deferred = deferred) -> Any:
                    events.append(f"fetch {d.name}")
                    return d()

                inputs[name] = Deferred(name, fetch)
            events.append("execute")
            return super().execute(components, **inputs)

    runner = LocalRunner(root, classes={**CLASSES, "flux.transformer": RecordingTransformer})
    spec = specs["tiny-flux-controlnet"]
    given = request(spec.name)

    image = run(runner, spec, given, models, edges=control_image)

    one_step = [
        "execute",
        "double block 0",
        "fetch controlnet_block_samples",
        "single block 0",
        "fetch controlnet_single_block_samples",
    ]
    assert events == one_step * given["num_inference_steps"]
    expected = pipes.image("tiny-flux", resolved(spec, given), control_image=control_image)
    assert image.same(expected)


def test_the_generator_state_continues_the_controlnet_pipelines_draw_order_after_crossing_as_bytes(
    models: dict[str, Path], control_image: Image.Image
) -> None:
    model = str(models["tiny-flux"])
    encoder, prepare = flux_controlnet.FluxControlImageEncoder(), flux.FluxPrepareLatents()
    enc_components, prep_components = encoder.load_model(model), prepare.load_model(model)
    encoded = encoder.execute(enc_components, control_image=control_image, height=64, width=96, seed=3)
    state = encoded["generator_state"]
    over_the_wire = torch.frombuffer(bytearray(state.numpy().tobytes()), dtype=state.dtype)
    dims = dict(height=64, width=96, num_inference_steps=2)

    continued = prepare.execute(prep_components, seed=3, generator_state=over_the_wire, **dims)["latents"]
    fresh = prepare.execute(prep_components, seed=3, **dims)["latents"]

    # What the pipeline does: one generator, VAE sample first, then the noise.
    generator = torch.Generator().manual_seed(3)
    torch.randn((1, 4, 32, 48), generator=generator)  # the control latents' posterior sample
    noise = torch.randn((1, 4, 32, 48), generator=generator)
    assert encoded["controlnet_cond"].shape == (1, 16 * 24, 16)
    assert torch.equal(continued, flux._pack_latents(noise, 32, 48))
    assert not torch.equal(continued, fresh)


def test_tiny_flux_is_the_first_family_workflow_and_binds_none_of_the_optional_inputs(
    specs: dict[str, WorkflowSpec],
) -> None:
    spec = tiny_flux()
    assert flux_workflows()[0] == spec
    loop = spec.body[-2]
    (transformer,) = [op for op in loop.body if op.id == "transformer"]
    assert set(transformer.inputs) | set(transformer.consts) <= {
        "latents",
        "timesteps",
        "step",
        "guidance_scale",
        "prompt_embeds",
        "pooled_prompt_embeds",
        "text_ids",
        "latent_image_ids",
    }
    assert set(specs) == {*FAMILY, "tiny-flux-cfg-parallel"}


def test_signatures_and_family_specs_are_read_and_validated_in_a_process_that_cannot_import_torch() -> None:
    code = (
        "import json, sys\n"
        "for name in ('torch', 'diffusers', 'transformers', 'numpy', 'peft', 'PIL'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        "from libs.models.workflows import MODELFNS, flux_workflows\n"
        "from libs.workflow.validate import validate_spec\n"
        "sigs = {c.fn_name: c.signature() for c in MODELFNS}\n"
        "names = [validate_spec(s, sigs).name for s in flux_workflows()]\n"
        "print(json.dumps({'sigs': {n: [s.inputs, s.outputs, s.optional] for n, s in sigs.items()},\n"
        "                  'names': names}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["sigs"] == {name: list(io) for name, io in EXPECTED_IO.items()}
    assert got["names"] == [*FAMILY, "tiny-flux-cfg-parallel"]


def test_the_entry_points_name_every_family_class_by_its_fn_name() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="serverless_t2i.modelfns")}
    missing = [cls.fn_name for cls in MODELFNS if cls.fn_name not in eps]
    if missing:
        pytest.skip(f"entry points not registered (yet) for {missing}")
    controlnet_fns = {"flux.control_encoder", "flux.controlnet"}  # in libs.models.flux_controlnet
    for cls in MODELFNS:
        module = "libs.models.flux_controlnet" if cls.fn_name in controlnet_fns else "libs.models.flux"
        assert eps[cls.fn_name] == f"{module}:{cls.__name__}"


def test_build_is_idempotent_writes_manifests_and_a_non_zero_lora(
    models: dict[str, Path], root: Path
) -> None:
    from safetensors import safe_open

    marks = {name: (path / "t2i-model.json" if path.is_dir() else path) for name, path in models.items()}
    before = {name: p.stat().st_mtime_ns for name, p in marks.items()}

    assert build(root) == models
    assert {name: p.stat().st_mtime_ns for name, p in marks.items()} == before
    assert set(models) == {"tiny-flux", "tiny-flux-schnell", "tiny-flux-controlnet", LORA_NAME}
    assert models[LORA_NAME] == root / "loras" / "tiny-flux-style.safetensors"
    assert read_manifest(models["tiny-flux"]) == {"preset": "tiny", "seed": 0, "family": "flux"}
    assert read_manifest(models["tiny-flux-schnell"]) == {
        "preset": "tiny",
        "seed": 0,
        "family": "flux",
        "variant": "schnell",
    }
    assert read_manifest(models["tiny-flux-controlnet"]) == {
        "preset": "tiny",
        "seed": 0,
        "family": "flux-controlnet",
    }
    assert json.loads(lora_manifest_path(models[LORA_NAME]).read_text())["family"] == "flux-lora"
    with safe_open(str(models[LORA_NAME]), framework="pt") as f:
        keys = list(f.keys())
        assert keys and all(k.startswith("transformer.") for k in keys)
        assert all(f.get_tensor(k).abs().sum() > 0 for k in keys), "no zero lora_B"
        assert "lora_adapter_metadata" in (f.metadata() or {})


def test_a_lora_whose_manifest_is_missing_is_rebuilt(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from libs.models.tiny import build_lora

    path = tmp_path / "loras" / "x.safetensors"
    build_lora(path)
    first = {k: v.clone() for k, v in load_file(path).items()}  # not views of the mapped file
    lora_manifest_path(path).unlink()
    path.write_bytes(b"truncated")

    build_lora(path)

    again = load_file(path)  # the same tensors (safetensors orders its header as it likes)
    assert sorted(again) == sorted(first) and all(torch.equal(again[k], first[k]) for k in first)
    assert lora_manifest_path(path).is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.safetensors", "x.t2i-lora.json"]
