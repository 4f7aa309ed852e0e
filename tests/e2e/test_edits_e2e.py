"""The img2img and inpainting workflows of SD3, Flux, Z-Image, Flux.2 Klein and Qwen-Image through the
whole platform (``POST /v1/images/edits``: the picture uploaded, the mask OpenAI's way, a PNG whose
fully transparent pixels repaint), each image equal to its diffusers pipeline's on the same inputs;
and ``n=2`` with ``response_format=url``: both images fetched from their URLs, equal to the
pipeline's at the seeds the gateway gave them (the request's and the next).

The requests are the unit harnesses' (``tests/unit/model_families.py``: each family's request, the
pictures and the pipeline calls of ``tests/unit/test_img2img_inpaint.py``) at 64x64 with 2 denoising
steps. The stack (two executors under a 1 MiB weight budget) is ``conftest.py``'s, one per module.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.support.catalog import KEY, edit, pixels

pytestmark = pytest.mark.e2e

# The form's own fields (OpenAI's and our extensions); every other parameter goes as params[name].
FIELDS = ("prompt", "seed", "num_inference_steps", "strength", "guidance_scale")
SIZE = 64
# 3 steps at strength 0.6: the pipelines' get_timesteps keep the last 2, so 2 denoising steps run,
# from a timestep below the first (at which the flow-matching schedules start from pure noise and
# an img2img would not see its picture).
STEPS, STRENGTH = 3, 0.6
EDITS = [
    "tiny-sd3-inpaint",
    "tiny-flux-img2img",
    "tiny-zimage-inpaint",
    "tiny-flux2-klein-inpaint",
    "tiny-qwenimage-img2img",
]
_HARNESSES: dict[str, Any] = {}
_PIPES: dict[tuple[Path, str], Any] = {}


def harness(family: str, root: Path) -> Any:
    """The family's unit harness over the stack's own models (built already: the build skips them)."""
    from tests.unit.model_families import HARNESSES

    if family not in _HARNESSES:
        _HARNESSES[family] = HARNESSES[family](root)
    return _HARNESSES[family]


def openai_mask(size: tuple[int, int]) -> tuple[Image.Image, Image.Image]:
    """OpenAI's mask for a picture of ``size`` (RGBA: alpha 0 repaints, any other alpha keeps) and the
    same mask as the pipelines take it (``mask_image``: white repaints, black keeps). Translucent
    pixels (a corner at alpha 128, a band at alpha 1) are kept: only fully transparent ones repaint."""
    w, h = size
    alpha = np.full((h, w), 255, np.uint8)
    alpha[: h // 3, : w // 2] = 128  # kept
    alpha[h // 3 : h // 3 + 2, :] = 1  # kept
    alpha[h // 4 : 3 * h // 4, w // 3 :] = 0  # repainted
    rgb = np.random.default_rng(1).integers(0, 256, (h, w, 3), dtype=np.uint8)  # colour: ignored
    return (
        Image.fromarray(np.dstack([rgb, alpha]), "RGBA"),
        Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), "L"),
    )


def case(
    catalog_models: Path, workflow: str, **changes: Any
) -> tuple[Any, dict[str, Any], dict[str, Image.Image]]:
    """The harness, the resolved request and the uploads (picture, OpenAI mask) of an edit."""
    from tests.unit.test_img2img_inpaint import WORKFLOWS, picture

    h = harness(WORKFLOWS[workflow][0], catalog_models)
    params = h.request(
        workflow, height=SIZE, width=SIZE, num_inference_steps=STEPS, strength=STRENGTH, **changes
    )
    files = {"image": picture(params["width"], params["height"])}  # a pixel larger: resized
    if "mask" in params:
        files["mask"] = openai_mask(files["image"].size)[0]
    return h, params, files


def form(workflow: str, params: dict[str, Any]) -> dict[str, Any]:
    """The edit form's text fields for the resolved request ``params``."""
    fields: dict[str, Any] = {"model": workflow, "size": f"{params['width']}x{params['height']}"}
    for name, value in params.items():
        if name in ("width", "height", "image", "mask"):
            continue
        fields[name if name in FIELDS else f"params[{name}]"] = value
    return fields


def reference(h: Any, workflow: str, params: dict[str, Any], files: dict[str, Image.Image]) -> np.ndarray:
    """The pipeline's image for the request, called as ``test_img2img_inpaint`` calls it, with the
    uploaded picture and the mask in the pipelines' convention."""
    import diffusers
    import torch

    from tests.unit.test_img2img_inpaint import WORKFLOWS, pipeline_kwargs

    family, cls_name, _ = WORKFLOWS[workflow]
    key = (h.root, cls_name)
    if key not in _PIPES:
        pipe = getattr(diffusers, cls_name).from_pretrained(h.paths.get(h.base, h.root / h.base))
        pipe.set_progress_bar_config(disable=True)
        _PIPES[key] = pipe
    kwargs = {**pipeline_kwargs(family, workflow, params), "image": files["image"]}
    if "mask" in params:
        kwargs["mask_image"] = openai_mask(files["image"].size)[1]
    generator = torch.Generator().manual_seed(params["seed"])
    return np.array(_PIPES[key](params["prompt"], generator=generator, **kwargs).images[0])


@pytest.mark.parametrize("workflow", EDITS)
def test_an_edit_through_the_stack_equals_its_pipeline(stack, catalog_models, workflow):
    import torch

    torch.set_num_threads(1)
    h, params, files = case(catalog_models, workflow)
    got = edit(stack, files, **form(workflow, params))
    assert [item.get("seed") for item in got["data"]] == [params["seed"]]
    image = pixels(got["data"][0]["b64_json"])
    assert image.shape == (SIZE, SIZE, 3)
    assert np.unique(image).size > 10, "a flat image would make the comparison meaningless"
    assert np.array_equal(image, reference(h, workflow, params, files))


def test_two_images_of_one_edit_fetched_by_url_equal_the_pipeline_at_seed_and_seed_plus_one(
    stack, catalog_models
):
    import httpx
    import torch

    torch.set_num_threads(1)
    workflow = "tiny-sd3-inpaint"
    h, params, files = case(catalog_models, workflow, seed=21)
    got = edit(stack, files, **form(workflow, params), n=2, response_format="url")
    assert [item["seed"] for item in got["data"]] == [21, 22]
    images = []
    for item in got["data"]:
        assert "b64_json" not in item
        resp = httpx.get(item["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert resp.status_code == 200 and resp.headers["Content-Type"] == "image/png", resp.text
        images.append(np.array(Image.open(io.BytesIO(resp.content))))
    assert not np.array_equal(images[0], images[1])
    for image, seed in zip(images, (21, 22), strict=True):
        assert np.array_equal(image, reference(h, workflow, {**params, "seed": seed}, files)), seed
