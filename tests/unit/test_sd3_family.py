"""What only the SD3 family has: both branches of ``force_zeros_for_pooled_projection``, the control
image's VAE sample drawn without touching the global RNG, LoRA metadata that must say alpha = r, and
the builder.

References are the monolithic ``StableDiffusion3Pipeline`` / ``StableDiffusion3ControlNetPipeline``.
The ControlNet pipeline samples the control image's VAE latents from the *global* RNG;
``sd3.control_image`` draws them from a private generator seeded with the request's seed, so references
seed the global RNG with ``torch.manual_seed(seed)`` right before the call (see
``libs/models/sd3_controlnet.py``). What every family shares (each workflow equals its pipeline bitwise,
warm LoRA switching, mid-forward fetches, signatures, entry points) is ``test_each_family.py``; the
harness is :class:`tests.unit.model_families.Sd3`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.models import sd3, tiny_sd3
from libs.models.sd3_workflows import sd3_workflow
from libs.workflow.local import LocalRunner
from tests.unit.model_families import CONTROL, Result, Sd3, harness

# The thread count changes the bits: pipelines and nodes alike run on one thread.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Sd3:
    return harness("sd3", tmp_path_factory)  # type: ignore[return-value]


def test_a_controlnet_that_keeps_pooled_projections_and_the_vae_shift_matches_its_pipeline(h: Sd3) -> None:
    # The other branch of the ControlNet pipeline's steps 3 and 6: pooled projections passed, VAE
    # shift subtracted.
    folder = h.root / "tiny-sd3-controlnet-pooled"
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
        max_sequence_length=h.MAX_SEQ,
    )
    params = h.request("tiny-sd3-controlnet", control_scale=1.3, seed=4)
    runner = LocalRunner(h.root, classes=h.classes())
    image = runner.run(spec, params, images={CONTROL: h.control_image()})["image"]

    assert Result(image.numpy()).same(h.reference("tiny-sd3-controlnet", params, controlnet=str(folder)))


def test_a_workflow_whose_force_zeros_flag_contradicts_the_controlnet_config_is_refused(h: Sd3) -> None:
    spec = sd3_workflow(
        "tiny-sd3-controlnet-wrong",
        "tiny-sd3",
        sizes=["64x64"],
        controlnet="tiny-sd3-controlnet",
        force_zeros_for_pooled_projection=False,  # the tiny ControlNet has True
    )

    with pytest.raises(ValueError, match="force_zeros_for_pooled_projection"):
        LocalRunner(h.root, classes=h.classes()).run(
            spec, h.request("tiny-sd3-controlnet"), images={CONTROL: h.control_image()}
        )


def test_the_control_image_node_leaves_the_global_rng_alone(h: Sd3) -> None:
    params = h.request("tiny-sd3-controlnet", num_inference_steps=1)
    h.run(h.runner, "tiny-sd3-controlnet", params)  # warm: nothing left to load
    torch.manual_seed(12345)
    before = torch.random.get_rng_state()
    first = h.run(h.runner, "tiny-sd3-controlnet", params)
    torch.manual_seed(999)  # another global state must not change the result
    second = h.run(h.runner, "tiny-sd3-controlnet", params)

    torch.manual_seed(12345)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert np.array_equal(first.image, second.image)


def test_a_lora_whose_metadata_sets_alpha_other_than_rank_is_refused() -> None:
    sd3._check_lora_metadata("ok.safetensors", {"transformer.r": 4, "transformer.lora_alpha": 4})

    with pytest.raises(ValueError, match="lora_alpha=8"):
        sd3._check_lora_metadata("x.safetensors", {"transformer.r": 4, "transformer.lora_alpha": 8})


def test_the_workflows_declare_the_platform_parameters(h: Sd3) -> None:
    specs = h.specs

    assert sorted(specs) == [
        *("tiny-sd3", "tiny-sd3-controlnet", "tiny-sd3-controlnet-lora", "tiny-sd3-img2img"),
        *("tiny-sd3-inpaint", "tiny-sd3-lora"),
    ]
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
    assert set(specs["tiny-sd3-img2img"].params) == base | {"image", "strength"}
    assert set(specs["tiny-sd3-inpaint"].params) == base | {"image", "mask", "strength"}
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


def test_build_is_idempotent_and_leaves_complete_artifacts(h: Sd3) -> None:
    from diffusers import SD3ControlNetModel

    root, paths = h.root, h.paths
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
