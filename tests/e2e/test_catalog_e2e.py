"""The catalog through the whole platform: registered over HTTP, ControlNet and LoRA requests served
by two executors (the ControlNet in parallel with the base model, its outputs forwarded and fetched
mid-forward), images equal to the monolithic diffusers pipelines; bad requests refused meanwhile.

The executors' weight budget (1 MiB) is smaller than one tiny workflow's models (~1.4 MB), so the
workflows evict each other's layers between requests (and within one), and every image is still
bitwise the pipeline's: evicted layers are reloaded, pipelined behind the layers still resident.

The stack and the built models are the fixtures of ``conftest.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from libs.models import families
from libs.workflow.spec import encode_spec
from tests.support.catalog import KEY, control_picture, edit, pixels, png_b64, state

pytestmark = pytest.mark.e2e


def test_every_catalog_workflow_is_registered_and_listed(stack):
    status, body = stack.http("GET", "/v1/workflows", key=KEY)
    names = {w["name"] for w in body["data"]}
    assert status == 200 and names == {spec.name for spec in families.workflows()}
    assert len(names) >= 20
    for family in (
        *("tiny-sd15", "tiny-sd3", "tiny-flux", "tiny-flux-schnell", "tiny-sana"),
        *("tiny-zimage", "tiny-zimage-turbo"),
    ):
        assert {family, f"{family}-controlnet", f"{family}-lora", f"{family}-controlnet-lora"} <= names


def test_an_sd15_controlnet_lora_request_equals_the_pipeline_and_its_controlnet_ran_in_parallel(
    stack, catalog_models
):
    import torch

    from tests.unit.model_families import sd_pipeline_image as pipeline_image

    torch.set_num_threads(1)
    control = control_picture(64, 64)
    params = {
        "prompt": "a red boat",
        "negative_prompt": "",
        "seed": 4,
        "height": 64,
        "width": 64,
        "num_inference_steps": 6,
        "guidance_scale": 7.5,
        "lora_scale": 0.8,
    }
    body = {
        "model": "tiny-sd15-controlnet-lora",
        "prompt": params["prompt"],
        "seed": 4,
        "size": "64x64",
        "num_inference_steps": 6,
        "params": {"control_image": png_b64(control), "lora": "tiny-sd15-style", "lora_scale": 0.8},
    }
    status, resp = stack.http("POST", "/v1/images/generations", body, key=KEY)
    assert status == 200, (resp, stack.tail("scheduler"))
    want = pipeline_image(catalog_models, params, control_image=control, lora="style")
    assert np.array_equal(pixels(resp["data"][0]["b64_json"]), want)
    st = state(stack, resp["id"])
    assert int(st["callbacks_forwarded"]) >= 1, st  # a UNet started before its ControlNet finished
    assert "," in st["executors"]


def test_warm_executors_switch_loras_between_requests(stack, catalog_models):
    import torch

    from tests.unit.model_families import sd_pipeline_image as pipeline_image

    torch.set_num_threads(1)
    base = {
        "prompt": "a hill",
        "negative_prompt": "",
        "seed": 9,
        "height": 64,
        "width": 64,
        "num_inference_steps": 3,
        "guidance_scale": 7.5,
    }
    seen = []
    for lora, scale in (
        ("tiny-sd15-style", 1.0),
        ("", 1.0),
        ("tiny-sd15-other", 1.0),
        ("tiny-sd15-style", 0.5),
    ):
        body = {
            "model": "tiny-sd15-lora",
            "prompt": "a hill",
            "seed": 9,
            "size": "64x64",
            "num_inference_steps": 3,
            "params": {"lora": lora, "lora_scale": scale},
        }
        status, resp = stack.http("POST", "/v1/images/generations", body, key=KEY)
        assert status == 200, resp
        want = pipeline_image(
            catalog_models, {**base, "lora_scale": scale}, lora=lora.removeprefix("tiny-sd15-") or None
        )
        got = pixels(resp["data"][0]["b64_json"])
        assert np.array_equal(got, want), (lora, scale)
        seen.append(got)
    assert all(not np.array_equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1 :])  # four images


def test_bad_adapters_and_specs_are_refused_and_the_platform_keeps_serving(stack):
    control = png_b64(control_picture(64, 64))
    bad_requests = [
        (
            {"model": "tiny-sd15-controlnet", "prompt": "x", "params": {"control_image": "not an image"}},
            "params.control_image",
        ),
        ({"model": "tiny-sd15-lora", "prompt": "x", "params": {"lora": "no-such-lora"}}, "params.lora"),
        ({"model": "tiny-sd15-controlnet", "prompt": "x"}, "control_image"),
    ]
    for body, param in bad_requests:
        status, resp = stack.http("POST", "/v1/images/generations", body, key=KEY)
        assert status == 422 and resp["error"]["param"] == param, resp
    spec = json.loads(encode_spec(families.workflows()[0]))
    spec["name"] = "broken"
    spec["body"][0]["fn"] = "no.such_fn"
    status, resp = stack.http("POST", "/v1/workflows", spec, key=KEY)
    assert status == 422 and resp["error"]["param"] == "body[0].fn"
    body = {
        "model": "tiny-sd15-controlnet",
        "prompt": "fine",
        "size": "64x64",
        "num_inference_steps": 2,
        "params": {"control_image": control},
    }
    status, resp = stack.http("POST", "/v1/images/generations", body, key=KEY)
    assert status == 200, resp
    assert all(p.poll() is None for p in stack.procs.values())


def flux_params(**more):
    params = {
        "prompt": "a lighthouse",
        "seed": 11,
        "width": 128,
        "height": 64,
        "num_inference_steps": 3,
        "guidance_scale": 3.5,
        "max_sequence_length": 32,
    }
    params.update(more)
    return params


def test_a_flux_controlnet_lora_request_equals_the_pipeline(stack, built):
    import torch

    from tests.unit.model_families import FluxPipes as Pipes

    torch.set_num_threads(1)
    control = control_picture(72, 80)
    body = {
        "model": "tiny-flux-controlnet-lora",
        "prompt": "a lighthouse",
        "seed": 11,
        "size": "128x64",
        "num_inference_steps": 3,
        "params": {
            "max_sequence_length": 32,
            "control_image": png_b64(control),
            "control_scale": 0.7,
            "lora": "tiny-flux-style",
            "lora_scale": 0.8,
        },
    }
    status, resp = stack.http("POST", "/v1/images/generations", body, key=KEY)
    assert status == 200, (resp, stack.tail("scheduler"))
    want = Pipes(built[1]).image(
        "tiny-flux", flux_params(control_scale=0.7), control_image=control, lora_scale=0.8
    )
    assert np.array_equal(pixels(resp["data"][0]["b64_json"]), want.image)


def test_cfg_parallel_runs_both_passes_of_a_step_on_two_executors_and_equals_true_cfg(stack, built):
    import torch

    from tests.unit.model_families import FluxPipes as Pipes

    torch.set_num_threads(1)
    body = {
        "model": "tiny-flux-cfg-parallel",
        "prompt": "a lighthouse",
        "seed": 11,
        "size": "128x64",
        "num_inference_steps": 3,
        "params": {"max_sequence_length": 32, "negative_prompt": "blurry", "true_cfg_scale": 2.5},
    }
    status, resp = stack.http("POST", "/v1/images/generations", body, key=KEY)
    assert status == 200, resp
    want = Pipes(built[1]).image("tiny-flux", flux_params(), negative_prompt="blurry", true_cfg_scale=2.5)
    assert np.array_equal(pixels(resp["data"][0]["b64_json"]), want.image)
    assert len(state(stack, resp["id"])["executors"].split(",")) == 2


def test_the_executors_evicted_layers_under_their_budget_and_served_every_request_meanwhile(stack):
    # Runs after the requests above (file order): under a 1 MiB budget they evicted each other.
    logs = "".join(stack.read_log(name) for name in stack.procs if name.startswith("executor"))
    assert "evicted " in logs and " layers (" in logs, logs[-3000:]
    assert all(p.poll() is None for p in stack.procs.values())


def test_sd15_img2img_and_inpaint_edits_through_the_stack_equal_the_pipelines(stack, catalog_models):
    """An upload, OpenAI's transparent-is-repaint mask, the strength-cut schedule and the per-step
    blend, end to end: the images equal diffusers' StableDiffusionImg2Img/InpaintPipeline's."""
    import diffusers
    import torch

    torch.set_num_threads(1)
    picture = control_picture(64, 64)
    alpha = np.full((64, 64), 255, np.uint8)
    alpha[16:48, 24:] = 0  # transparent: repaint
    openai_mask = Image.fromarray(np.dstack([np.zeros((64, 64, 3), np.uint8), alpha]), "RGBA")
    white_repaints = Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), "L")
    common = dict(prompt="a red boat", seed=5, size="64x64", num_inference_steps=5, strength=0.6)
    got_img2img = edit(stack, {"image": picture}, model="tiny-sd15-img2img", **common)
    got_inpaint = edit(stack, {"image": picture, "mask": openai_mask}, model="tiny-sd15-inpaint", **common)
    root = catalog_models / "tiny-sd15"
    kw = dict(num_inference_steps=5, strength=0.6, guidance_scale=7.5, negative_prompt="")
    img2img = diffusers.StableDiffusionImg2ImgPipeline.from_pretrained(root)
    img2img.set_progress_bar_config(disable=True)
    want = img2img("a red boat", image=picture, generator=torch.Generator().manual_seed(5), **kw).images[0]
    assert np.array_equal(pixels(got_img2img["data"][0]["b64_json"]), np.array(want))
    inpaint = diffusers.StableDiffusionInpaintPipeline.from_pretrained(root)
    inpaint.set_progress_bar_config(disable=True)
    want = inpaint(
        "a red boat", image=picture, mask_image=white_repaints, height=64, width=64,
        generator=torch.Generator().manual_seed(5), **kw,
    ).images[0]  # fmt: skip
    assert np.array_equal(pixels(got_inpaint["data"][0]["b64_json"]), np.array(want))


def test_a_qwenimage_instruction_edit_through_the_stack_equals_the_edit_pipeline(stack, catalog_models):
    """The instruction edit of a new family, its picture uploaded through ``/v1/images/edits``: the
    VL encoder with the image, the image latents and the transformer over both, on the executors,
    equal ``QwenImageEditPipeline``'s image."""
    import torch

    from tests.unit.model_families import QwenImage

    torch.set_num_threads(1)
    h = QwenImage(catalog_models)  # the harness over the stack's own models (already built)
    params = h.request("tiny-qwenimage-edit", num_inference_steps=2, image="in")
    got = edit(
        stack,
        {"image": h.edit_image()},
        model="tiny-qwenimage-edit",
        prompt=params["prompt"],
        seed=params["seed"],
        size=f"{params['width']}x{params['height']}",
        num_inference_steps=2,
        **{f"params[{k}]": params[k] for k in ("negative_prompt", "true_cfg_scale", "max_sequence_length")},
    )
    want = h.reference("tiny-qwenimage-edit", params)
    assert np.array_equal(pixels(got["data"][0]["b64_json"]), want.image)
