"""What only the Flux family has: schnell's defaults, parallel true CFG, the generator state the
ControlNet pipeline's draw order needs, one warm transformer that never fuses a LoRA, and the builder.

What every family shares (each workflow equals its pipeline bitwise, warm LoRA switching, mid-forward
fetches, signatures, entry points) is ``test_each_family.py``; the harness is
:class:`tests.unit.model_families.Flux`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from libs.models import flux, flux_controlnet
from libs.models.flux_workflows import tiny_flux, workflows
from libs.models.tiny_flux import LORA_NAME, build, lora_manifest_path, read_manifest
from libs.workflow.local import LocalRunner
from tests.unit.model_families import NEGATIVE, Flux, harness

# The thread count changes the bits: pipelines and nodes alike run on one thread.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Flux:
    return harness("flux", tmp_path_factory)  # type: ignore[return-value]


def test_schnell_workflows_default_to_four_steps_and_no_guidance_and_the_transformer_embeds_none(
    h: Flux,
) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    for name in ("tiny-flux-schnell", "tiny-flux-schnell-controlnet-lora"):
        assert h.specs[name].params["num_inference_steps"].default == 4
        assert h.specs[name].params["guidance_scale"].default == 0.0
    schnell = h.paths["tiny-flux-schnell"]
    assert not FluxTransformer2DModel.load_config(schnell, subfolder="transformer")["guidance_embeds"]
    scheduler = FlowMatchEulerDiscreteScheduler.load_config(schnell, subfolder="scheduler")
    assert scheduler["use_dynamic_shifting"] is False and scheduler["shift"] == 1.0


def test_parallel_true_cfg_reproduces_the_pipelines_negative_prompt_bitwise(h: Flux) -> None:
    name = "tiny-flux-cfg-parallel"
    params = h.request(name, negative_prompt=NEGATIVE, true_cfg_scale=2.5)

    image = h.run(h.runner, name, params)
    expected = h.reference(name, params, negative_prompt=NEGATIVE, true_cfg_scale=2.5)
    without_cfg = h.reference(name, params)

    assert image.same(expected)
    assert not np.array_equal(image.image, without_cfg.image), "the negative branch must matter"
    nodes = [op.id for op in h.specs[name].body[-2].body]  # the denoising loop's body
    assert nodes == ["transformer", "transformer_neg", "cfg", "euler"]


def test_parallel_true_cfg_with_the_default_negative_prompt_and_scale_one_matches_the_pipeline(
    h: Flux,
) -> None:
    name = "tiny-flux-cfg-parallel"
    default_scale = h.request(name)  # negative_prompt "" still counts as a negative prompt
    scale_one = h.request(name, negative_prompt=NEGATIVE, true_cfg_scale=1.0)  # do_true_cfg is false

    image = h.run(h.runner, name, default_scale)
    expected = h.reference(
        name, default_scale, negative_prompt="", true_cfg_scale=h.specs[name].params["true_cfg_scale"].default
    )
    assert image.same(expected)
    image = h.run(h.runner, name, scale_one)
    assert image.same(h.reference(name, scale_one, negative_prompt=NEGATIVE))


def test_the_control_scale_and_the_control_image_each_change_the_image(h: Flux) -> None:
    name = "tiny-flux-controlnet"
    other_image = Image.fromarray(255 - np.array(h.control_image()), "RGB")

    controlled = h.run(h.runner, name, h.request(name))
    weaker = h.run(h.runner, name, h.request(name, control_scale=0.2))
    other = h.run(h.runner, name, h.request(name), control=other_image)

    images = [controlled, weaker, other]
    assert len({image.image.tobytes() for image in images}) == len(images)


def test_one_warm_transformer_switches_lora_per_request_and_never_fuses(h: Flux) -> None:
    kept: list[dict[str, Any]] = []

    class KeptTransformer(flux.FluxTransformer):
        def load_model(self, model_path: str, device: str) -> dict[str, Any]:
            kept.append(super().load_model(model_path, device))
            return kept[-1]

    runner = LocalRunner(h.root, classes=h.classes(**{"flux.transformer": KeptTransformer}))
    name = "tiny-flux-lora"
    # (that each of these equals its pipeline is test_each_family.py's warm-runner test)
    for params in (
        h.request(name, lora_scale=1.0),
        h.request(name, lora=""),
        h.request(name, lora_scale=0.5),
    ):
        h.run(runner, name, params)

    (components,) = kept  # one warm transformer served every request
    assert len(components["lora"].loaded) == 1, "the adapter is loaded once and kept"
    transformer = components["transformer"]
    assert transformer.peft_config  # the adapter lives in separate PEFT layers
    # The file's adapter metadata (alpha 8, rank 4) was honoured: scaling = scale * 8 / 4.
    layer = transformer.transformer_blocks[0].attn.to_q
    assert layer.scaling[components["lora"].loaded[0]] == 0.5 * 2
    # Never fused: every base weight equals the file's.
    from diffusers import FluxTransformer2DModel

    fresh = FluxTransformer2DModel.from_pretrained(h.paths["tiny-flux"], subfolder="transformer").state_dict()
    current = {
        k.replace(".base_layer", ""): v for k, v in transformer.state_dict().items() if "lora_" not in k
    }
    assert set(current) == set(fresh)
    assert all(torch.equal(current[k], fresh[k]) for k in fresh)


def test_the_generator_state_continues_the_controlnet_pipelines_draw_order_after_crossing_as_bytes(
    h: Flux,
) -> None:
    model = str(h.paths["tiny-flux"])
    encoder, prepare = flux_controlnet.FluxControlImageEncoder(), flux.FluxPrepareLatents()
    enc_components, prep_components = encoder.load_model(model, "cpu"), prepare.load_model(model, "cpu")
    control_image = h.control_image()
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


def test_tiny_flux_is_the_first_family_workflow_and_binds_none_of_the_optional_inputs() -> None:
    spec = tiny_flux()
    assert workflows()[0] == spec
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
        # step caching (libs.models.stepcache): its parameters and the state the loop carries
        "cache",
        "cache_threshold",
        "cache_state",
    }


def test_build_is_idempotent_writes_manifests_and_a_non_zero_lora(h: Flux) -> None:
    from safetensors import safe_open

    models, root = h.paths, h.root
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

    from libs.models.tiny_flux import build_lora

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
