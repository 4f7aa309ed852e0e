"""The model families, test by test where they have the same shape: every family's workflows run node
by node through LocalRunner reproduce the monolithic diffusers pipelines bitwise (tiny random models,
CFG, ControlNet, LoRA), warm runners switch LoRAs per request, denoisers fetch their ControlNet's
outputs mid-forward, and the families follow one naming scheme and one set of shared helpers.

Traps of one family stay in its own file (``test_flux_family.py``, ``test_sd_family.py``,
``test_sd3_family.py``, ``test_sana_family.py``); the harnesses (models, requests, pipelines) are
:mod:`tests.unit.model_families`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from libs.models import common, families
from libs.workflow.local import LocalRunner
from libs.workflow.modelfn import Deferred, ModelFn
from tests.unit.family_signatures import EXPECTED_IO
from tests.unit.model_families import FAMILIES, HARNESSES, Harness, harness, submodule

# diffusers' DPM-Solver builds its sigmas with np.array(tensor, copy=False) (numpy 2 warns).

REPO = Path(__file__).resolve().parents[2]

WORKFLOWS = {
    "flux": [
        *(
            f"tiny-flux{v}{s}"
            for v in ("", "-schnell")
            for s in ("", "-controlnet", "-lora", "-controlnet-lora")
        ),
        "tiny-flux-cfg-parallel",
        "tiny-flux-img2img",
        "tiny-flux-inpaint",
    ],
    "sd": [
        *("tiny-sd15", "tiny-sd15-controlnet", "tiny-sd15-lora", "tiny-sd15-controlnet-lora"),
        *("tiny-sd15-img2img", "tiny-sd15-inpaint"),
    ],
    "sd3": [
        *("tiny-sd3", "tiny-sd3-controlnet", "tiny-sd3-lora", "tiny-sd3-controlnet-lora"),
        *("tiny-sd3-img2img", "tiny-sd3-inpaint"),
    ],
    "sana": ["tiny-sana", "tiny-sana-controlnet", "tiny-sana-lora", "tiny-sana-controlnet-lora"],
    "zimage": [
        *(
            f"tiny-zimage{v}{s}"
            for v in ("", "-turbo")
            for s in ("", "-controlnet", "-lora", "-controlnet-lora")
        ),
        *("tiny-zimage-img2img", "tiny-zimage-inpaint"),
    ],
    "flux2": [
        "tiny-flux2-klein",
        "tiny-flux2-klein-lora",
        "tiny-flux2-klein-edit",
        "tiny-flux2-klein-inpaint",
    ],
    "qwenimage": [
        *(
            "tiny-qwenimage",
            "tiny-qwenimage-controlnet",
            "tiny-qwenimage-lora",
            "tiny-qwenimage-controlnet-lora",
        ),
        *("tiny-qwenimage-edit", "tiny-qwenimage-edit-plus"),
        *("tiny-qwenimage-img2img", "tiny-qwenimage-inpaint"),
    ],
}
# The ModelFns only the img2img, inpaint and (Flux.2) reference-edit workflows have: in
# libs.models.{family}_img2img.
IMG2IMG_FNS = {
    "flux": {"flux.vae_encode", "flux.inpaint_latents", "flux.inpaint_blend"},
    "sd": {"sd.vae_encode", "sd.inpaint_latents", "sd.inpaint_blend"},
    "sd3": {"sd3.vae_encode", "sd3.inpaint_latents", "sd3.inpaint_blend", "sd3.inpaint_vae_decode"},
    "zimage": {"zimage.vae_encode", "zimage.inpaint_latents", "zimage.inpaint_blend"},
    "flux2": {"flux2.inpaint_latents", "flux2.inpaint_blend", "flux2.reference_encode"},
    "qwenimage": {
        *("qwenimage.vae_encode", "qwenimage.inpaint_latents", "qwenimage.inpaint_blend"),
        *("qwenimage.edit_text_encoder", "qwenimage.edit_image_encode"),
        *("qwenimage.edit_plus_text_encoder", "qwenimage.edit_plus_image_encode"),
    },
}
# The ModelFns only the ControlNet pipeline has: in libs.models.{family}_controlnet.
CONTROLNET_FNS = {
    "flux": {"flux.control_encoder", "flux.controlnet"},
    "sd": {"sd.control_image", "sd.controlnet"},
    "sd3": {"sd3.control_image", "sd3.controlnet"},
    "sana": {"sana.control_encode", "sana.controlnet"},
    "zimage": {"zimage.control_encode", "zimage.controlnet"},
    "flux2": set(),  # diffusers has no Flux.2 Klein ControlNet pipeline
    "qwenimage": {"qwenimage.control_encode", "qwenimage.controlnet"},
}


# The thread count changes the bits: pipelines and nodes alike run on one thread.
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]


@pytest.fixture
def h(family: str, tmp_path_factory: pytest.TempPathFactory) -> Harness:
    return harness(family, tmp_path_factory)


def modelfns(family: str) -> list[type[ModelFn]]:
    return families.FAMILIES[family].module("workflows").MODELFNS


# -- the naming scheme and the shared helpers (no models built) ----------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_four_modules_of_one_naming_scheme(family: str) -> None:
    fam = families.FAMILIES[family]
    for role, module in fam.modules.items():
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), (role, module)
    img2img = f"libs.models.{family}_img2img"
    defined = {
        cls
        for module in [fam.modules["modelfns"], fam.modules["controlnet"]]
        + ([img2img] if family in IMG2IMG_FNS else [])
        for cls in vars(importlib.import_module(module)).values()
        if isinstance(cls, type) and issubclass(cls, ModelFn) and cls.__module__ == module
    }
    assert set(modelfns(family)) == defined, "MODELFNS lists the classes of the ModelFn modules"
    for cls in defined:
        assert cls.fn_name.startswith(f"{family}.")
        controlnet = cls.__module__ == fam.modules["controlnet"]
        assert controlnet == (cls.fn_name in CONTROLNET_FNS[family]), cls.fn_name
        assert (cls.__module__ == img2img) == (cls.fn_name in IMG2IMG_FNS.get(family, set())), cls.fn_name
    assert callable(fam.module("builder").build)
    assert [w.name for w in fam.module("workflows").workflows()] == WORKFLOWS[family]


def test_the_catalog_is_every_familys_workflows_and_loras() -> None:
    # then the trained models (libs.trained.catalog)
    assert [w.name for w in families.workflows()] == [w for f in FAMILIES for w in WORKFLOWS[f]] + [
        "flux-shapes"
    ]
    assert families.LORAS == {
        "tiny-flux-style": "loras/tiny-flux-style.safetensors",
        "tiny-sd15-style": "loras/tiny-sd15-style.safetensors",
        "tiny-sd3-style": "loras/tiny-sd3-style.safetensors",
        "tiny-sana-style": "loras/tiny-sana-style.safetensors",
        "tiny-zimage-style": "loras/tiny-zimage-style.safetensors",
        "tiny-flux2-style": "loras/tiny-flux2-style.safetensors",
        "tiny-qwenimage-style": "loras/tiny-qwenimage-style.safetensors",
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_signatures_and_workflows_are_read_and_validated_in_a_process_that_cannot_import_torch(
    family: str,
) -> None:
    code = (
        "import json, sys\n"
        "for name in ('torch', 'diffusers', 'transformers', 'numpy', 'peft', 'PIL'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        # the ControlNet half must not import torch either
        f"from libs.models import {family}, {family}_controlnet\n"
        f"from libs.models.{family}_workflows import MODELFNS, workflows\n"
        "from libs.workflow.validate import validate_spec\n"
        "sigs = {c.fn_name: c.signature() for c in MODELFNS}\n"
        "names = [validate_spec(s, sigs).name for s in workflows()]\n"
        "print(json.dumps({'sigs': {n: [s.inputs, s.outputs, s.optional] for n, s in sigs.items()},\n"
        "                  'names': names}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["sigs"] == {name: list(io) for name, io in EXPECTED_IO[family].items()}
    assert got["names"] == WORKFLOWS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_entry_points_name_each_class_by_its_module_and_fn_name(family: str) -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="serverless_t2i.modelfns")}
    missing = [cls.fn_name for cls in modelfns(family) if cls.fn_name not in eps]
    if missing:
        pytest.skip(f"entry points not registered (yet) for {missing}")
    for cls in modelfns(family):
        module = (
            f"libs.models.{family}_controlnet"
            if cls.fn_name in CONTROLNET_FNS[family]
            else f"libs.models.{family}_img2img"
            if cls.fn_name in IMG2IMG_FNS.get(family, set())
            else f"libs.models.{family}"
        )
        assert eps[cls.fn_name] == f"{module}:{cls.__name__}"
    assert {n for n in eps if n.startswith(f"{family}.")} == {cls.fn_name for cls in modelfns(family)}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_variant_declares_the_shared_controlnet_and_lora_parameters(family: str) -> None:
    shared = {**common.controlnet_params(), **common.lora_params()}
    for spec in families.FAMILIES[family].module("workflows").workflows():
        controlnet, lora = "-controlnet" in spec.name, "-lora" in spec.name
        expected = {
            **(common.controlnet_params() if controlnet else {}),
            **(common.lora_params() if lora else {}),
        }
        assert {k: v for k, v in spec.params.items() if k in shared} == expected, spec.name
    lora_scale = common.lora_params()["lora_scale"]
    assert (lora_scale.minimum, lora_scale.maximum, lora_scale.default) == (-4.0, 4.0, 1.0)
    control_scale = common.controlnet_params()["control_scale"]
    assert (control_scale.minimum, control_scale.maximum, control_scale.default) == (0.0, 4.0, 1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_model_takes_the_model_path_the_device_and_an_optional_loader(family: str) -> None:
    for cls in modelfns(family):
        params = inspect.signature(cls.load_model).parameters
        assert list(params) == ["self", "model_path", "device", "loader"]
        assert params["loader"].default is None
    for module in families.FAMILIES[family].modules.values():
        assert "T2I_DEVICE" not in (REPO / (module.replace(".", "/") + ".py")).read_text(), module


@pytest.mark.parametrize(
    ("pipeline", "max_shift"),
    [
        ("diffusers.pipelines.flux.pipeline_flux", 1.15),
        ("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3", 1.16),
    ],
)
def test_calculate_shift_is_diffusers_function(pipeline: str, max_shift: float) -> None:
    import importlib

    theirs = importlib.import_module(pipeline).calculate_shift
    for args in [(64,), (256,), (4096,), (1234, 256, 4096, 0.5, max_shift), (77, 128, 8192, 0.3, 1.7)]:
        assert common.calculate_shift(*args) == theirs(*args)  # the same float, not a close one


def test_to_uint8_image_is_the_pipelines_pil_image_and_vae_scale_factor_its_init_line() -> None:
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=8)
    decoded = torch.randn((1, 3, 24, 40), generator=torch.Generator().manual_seed(0)) * 1.2

    got = common.to_uint8_image(processor, decoded)

    assert got.dtype == torch.uint8 and got.shape == (24, 40, 3)
    assert np.array_equal(got.numpy(), np.array(processor.postprocess(decoded, output_type="pil")[0]))
    assert common.vae_scale_factor({"block_out_channels": [8, 16, 16, 16]}) == 8
    assert (
        common.vae_scale_factor({"encoder_block_out_channels": [8] * 6}, "encoder_block_out_channels") == 32
    )


def test_lazy_inputs_fetch_once_at_first_use_and_accept_unbound_or_fetched_values() -> None:
    fetches: list[str] = []

    def fetch(name: str, value: Any) -> Deferred:
        return Deferred(name, lambda: fetches.append(name) or value)

    samples = common.lazy_list(fetch("samples", [1, 2, 3]), lambda v: [x * 10 for x in v])
    addend = common.lazy_addend(fetch("residual", torch.ones(2)), lambda v: v * 2)
    assert fetches == [] and samples is not None and addend is not None
    assert not samples.fetched and len(samples) == 3 and samples[1] == 20 and list(samples) == [10, 20, 30]
    assert torch.equal(torch.zeros(2) + addend, torch.full((2,), 2.0))
    assert fetches == ["samples", "residual"], "each input is fetched once, when first used"
    assert common.lazy_list(None, list) is None and common.lazy_addend(None, lambda v: v) is None
    assert list(common.lazy_list([4, 5], list)) == [4, 5]  # an already fetched value


def test_the_variants_are_generated_in_one_order_with_their_descriptions() -> None:
    made = common.variant_workflows("x", "a family", lambda name, v, text: (name, v.controlnet, v.lora, text))  # type: ignore[arg-type,return-value]

    assert made == [
        ("x", False, False, "a family"),
        ("x-controlnet", True, False, "a family with ControlNet"),
        ("x-lora", False, True, "a family with LoRA"),
        ("x-controlnet-lora", True, True, "a family with ControlNet + LoRA"),
    ]


# -- every family's workflows against its pipelines -----------------------------------------------------

CASES = [
    pytest.param(f, w, changes, id=f"{f}-{label}")
    for f in FAMILIES
    for w, changes, label in HARNESSES[f].cases
]


@pytest.mark.parametrize(("family", "workflow", "changes"), CASES)
def test_every_workflow_run_node_by_node_equals_its_monolithic_pipeline_bitwise(
    h: Harness, workflow: str, changes: dict[str, Any]
) -> None:
    params = h.request(workflow, **changes)

    got = h.run(h.runner, workflow, params)
    expected = h.reference(workflow, params)

    assert got.image.shape == (params["height"], params["width"], 3)
    assert np.unique(got.image).size > 10, "a flat image would make the comparison meaningless"
    assert got.same(expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_controlnet_and_the_lora_each_change_the_image(h: Harness) -> None:
    controlnet, lora = f"{h.base}-controlnet", f"{h.base}-lora"
    if h.mid_forward is None:
        pytest.skip(f"{h.family} has no ControlNet workflow")

    base = h.run(h.runner, h.base, h.request(h.base))
    controlled = h.run(h.runner, controlnet, h.request(controlnet))
    styled = h.run(h.runner, lora, h.request(lora))
    unstyled = h.run(h.runner, lora, h.request(lora, lora=""))

    assert not np.array_equal(base.image, controlled.image)
    assert not np.array_equal(base.image, styled.image)
    assert not np.array_equal(controlled.image, styled.image)
    assert np.array_equal(unstyled.image, base.image), "lora='' is the base model"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_warm_runner_switching_lora_none_lora_gives_each_request_the_pipelines_image(h: Harness) -> None:
    warm = LocalRunner(h.root, classes=h.classes())
    lora = f"{h.base}-lora"
    requests = [
        h.request(lora, lora_scale=1.0, seed=1),
        h.request(lora, lora="", seed=1),
        h.request(lora, lora_scale=0.5, seed=1),
    ]

    images = [h.run(warm, lora, params) for params in requests]
    # ... and the workflow without LoRA parameters on the same warm denoiser, after a LoRA request
    plain = h.run(warm, h.base, h.request(h.base, seed=1))

    for params, image in zip(requests, images, strict=True):
        assert image.same(h.reference(lora, params)), params
    assert plain.same(images[1])
    assert len({image.image.tobytes() for image in images}) == len(images)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_denoiser_fetches_the_controlnet_outputs_mid_forward_and_the_image_is_unchanged(
    h: Harness,
) -> None:
    spec = h.mid_forward
    if spec is None:
        pytest.skip(f"{h.family} has no ControlNet workflow")
    events: list[str] = []
    base = h.classes()[h.denoiser]

    class Recording(base):  # type: ignore[valid-type,misc]
        def load_model(self, model_path: str, device: str) -> dict[str, Any]:
            components = super().load_model(model_path, device)
            for path, label in spec.hooks.items():
                block = submodule(components[spec.component], path)
                block.register_forward_hook(lambda *_, label=label: events.append(label))
            return components

        def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
            for name in spec.callbacks:
                deferred = inputs[name]
                assert isinstance(deferred, Deferred) and not deferred.fetched

                def fetch(d: Deferred = deferred) -> Any:
                    events.append(f"fetch {d.name}")
                    return d()

                inputs[name] = Deferred(name, fetch)
            events.append("execute")
            out = super().execute(components, **inputs)
            events.append("done")
            return out

    runner = LocalRunner(h.root, classes=h.classes(**{h.denoiser: Recording}))
    params = h.request(spec.workflow, **spec.changes)

    image = h.run(runner, spec.workflow, params)

    assert events == spec.per_step * params["num_inference_steps"]
    assert image.same(h.reference(spec.workflow, params))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_scheduler_step_rejects_timesteps_of_another_schedule(h: Harness) -> None:
    classes = h.classes()
    prepare_cls = classes[f"{h.family}.prepare_latents"]
    (step_cls,) = [c for n, c in classes.items() if n.endswith("_step")]
    model = str(h.root / h.base)
    prepare, step = prepare_cls(), step_cls()
    prepared = prepare.execute(
        prepare.load_model(model, "cpu"), seed=0, height=64, width=64, num_inference_steps=4, **h.step_rejects
    )
    history = {"solver_history": prepared["solver_history"]} if "solver_history" in prepared else {}

    with pytest.raises(ValueError, match="3-step"):
        step.execute(
            step.load_model(model, "cpu"),
            noise_pred=torch.zeros_like(prepared["latents"]),
            latents=prepared["latents"],
            timesteps=prepared["timesteps"],
            step=0,
            num_inference_steps=3,
            **history,
        )
