"""The official ``openai`` Python client, unchanged, against a live gateway.

One stack for the module (registry, scheduler, gateway and two simulated executors as processes,
over a private nats-server and the real Redis with credentials, as ``make run`` has them) with one quick workflow, ``fast-wf``,
registered by the admin tenant ``ops``. The simulated executors store real 64x64 PNGs, so what
comes back can be decoded.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openapi_spec_validator import validate
from PIL import Image

from libs.launcher.stack import Stack
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.support.stacks import sim_stack, started

KEYS = "sk-alice=alice,sk-ops=ops:admin"
WORKFLOW = "fast-wf"
EDIT = "fast-edit"  # the same simulated nodes, with the edit parameters: an upload fills them
MULTI = "fast-multi-edit"  # an edit of up to two pictures: image and image_2


def write_profile(path: Path) -> None:
    def fig(v: float) -> dict:
        return {"value": v, "tag": "D", "source": "test profile"}

    models = {
        f"fast/{part}": {
            "size_gb": fig(0.1),
            "load_s": fig(0.001),
            "exec_s": fig(0.002),
            "output_bytes": 1024,
        }
        for part in ("text", "prepare", "dit", "vae")
    }
    path.write_text(
        json.dumps(
            {
                "name": "test-openai",
                "description": "",
                "device": "sim",
                "gpu_memory_gb": fig(80),
                "models": models,
            }
        )
    )


@pytest.fixture(scope="module")
def stack(broker_urls, tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("openai")
    write_profile(tmp / "profile.json")
    nats_url, redis_url = broker_urls
    s = sim_stack(
        tmp,
        api_keys=KEYS,
        sim_profile=str(tmp / "profile.json"),
        nats_url=nats_url,
        redis_url=redis_url,
        secure=True,  # as `make run` runs it: the gateway's Redis user reaches only its own keys
    )
    with started(s):
        spec = json.loads(encode_spec(sim_workflow(WORKFLOW, "fast", steps=2, description="a quick one")))
        status, body = s.http("POST", "/v1/workflows", spec, key="sk-ops")
        assert status == 201, body
        status, body = s.http("POST", "/v1/workflows", edit_workflow(), key="sk-ops")
        assert status == 201, body
        status, body = s.http("POST", "/v1/workflows", multi_edit_workflow(), key="sk-ops")
        assert status == 201, body
        yield s


def edit_workflow() -> dict:
    """``fast-wf``'s nodes with an ``image`` and a ``mask`` parameter: it edits and inpaints (as far
    as the gateway can tell: simulated nodes draw their own picture)."""
    spec = json.loads(encode_spec(sim_workflow(EDIT, "fast", steps=2, description="an editor")))
    spec["params"]["image"] = {"type": "image", "required": True}
    spec["params"]["mask"] = {"type": "image"}
    spec["params"]["strength"] = {"type": "float", "default": 0.8, "minimum": 0.0, "maximum": 1.0}
    return spec


def multi_edit_workflow() -> dict:
    """``fast-wf``'s nodes taking a required ``image`` and an optional ``image_2``, as the
    multi-picture edits (Qwen-Image-Edit-Plus, Flux.2 Klein references) take them."""
    spec = json.loads(encode_spec(sim_workflow(MULTI, "fast", steps=2, description="two pictures")))
    spec["params"]["image"] = {"type": "image", "required": True}
    spec["params"]["image_2"] = {"type": "image"}
    return spec


def png(size: tuple[int, int] = (32, 32), mode: str = "RGB", color: object = "red") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-alice", max_retries=0, timeout=60)


def image_of(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()  # decodes the whole image: a truncated one fails here
    return img


def test_the_workflows_are_the_clients_models(client):
    listed = client.models.list()
    model = next(m for m in listed.data if m.id == WORKFLOW)
    assert model.object == "model" and model.owned_by == "ops" and model.created > 0
    again = client.models.retrieve(WORKFLOW)
    assert (again.id, again.created, again.owned_by) == (WORKFLOW, model.created, "ops")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-workflow")


def test_two_images_as_b64_json(client, stack):
    result = client.images.generate(model=WORKFLOW, prompt="a red fox", n=2, response_format="b64_json")
    assert len(result.data) == 2
    images = [image_of(base64.b64decode(item.b64_json)) for item in result.data]
    assert all(img.format == "PNG" and img.width > 0 for img in images)
    usage = result.usage.model_dump()
    assert usage["input_tokens"] == usage["output_tokens"] == 0
    assert len(usage["gpu_seconds_per_image"]) == 2
    assert usage["gpu_seconds"] == pytest.approx(sum(usage["gpu_seconds_per_image"]))
    assert usage["gpu_seconds"] > 0  # the simulated executors' measured time was charged
    # The lookup by the call's id reports the same usage.
    call_id = result.model_dump()["id"]
    status, body = stack.http("GET", f"/v1/requests/{call_id}", key="sk-alice")
    assert status == 200 and body["usage"]["gpu_seconds_per_image"] == usage["gpu_seconds_per_image"]


def test_two_images_as_urls(client, stack):
    result = client.images.generate(
        model=WORKFLOW, prompt="a blue fox", n=2, response_format="url", size="auto"
    )
    assert len(result.data) == 2
    for item in result.data:
        got = httpx.get(item.url, headers={"Authorization": "Bearer sk-alice"}, timeout=30)
        assert got.status_code == 200 and got.headers["content-type"] == "image/png"
        assert image_of(got.content).format == "PNG"
        assert httpx.get(item.url, timeout=30).status_code == 401  # the files need the key too


@pytest.mark.parametrize(("fmt", "pil"), [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_output_formats(client, fmt, pil):
    result = client.images.generate(
        model=WORKFLOW, prompt="a green fox", n=1, output_format=fmt, output_compression=70
    )
    assert image_of(base64.b64decode(result.data[0].b64_json)).format == pil
    assert result.output_format == fmt
    as_url = client.images.generate(
        model=WORKFLOW, prompt="a green fox", response_format="url", output_format=fmt
    )
    url = as_url.data[0].url
    assert url.endswith("." + fmt)
    got = httpx.get(url, headers={"Authorization": "Bearer sk-alice"}, timeout=30)
    assert got.headers["content-type"] == f"image/{fmt}" and image_of(got.content).format == pil


def test_bad_output_fields_are_422_naming_the_field(client):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.images.generate(model=WORKFLOW, prompt="x", output_format="png", output_compression=50)
    assert e.value.body["param"] == "output_compression"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.images.generate(model=WORKFLOW, prompt="x", output_format="gif")  # type: ignore[arg-type]
    assert e.value.body["param"] == "output_format"


def test_the_openapi_document_is_public_and_valid(stack):
    got = httpx.get(f"{stack.url}/openapi.json", timeout=30)
    assert got.status_code == 200
    doc = got.json()
    validate(doc)
    assert {
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/models",
        "/v1/models/{id}",
        "/openapi.json",
    } <= set(doc["paths"])


def test_models_list_what_each_workflow_can_do(client):
    models = {m.id: m.model_dump() for m in client.models.list().data}
    assert models[WORKFLOW]["capabilities"] == ["generate"]
    assert models[EDIT]["capabilities"] == ["edit", "inpaint"]  # it needs an image: it cannot generate


def test_an_edit_of_two_images_as_b64_json_without_a_mask(client):
    result = client.images.edit(
        model=EDIT,
        image=("cat.png", png(), "image/png"),
        prompt="make it blue",
        n=2,
        response_format="b64_json",
    )
    assert len(result.data) == 2
    assert all(image_of(base64.b64decode(item.b64_json)).format == "PNG" for item in result.data)
    assert result.usage.model_dump()["gpu_seconds"] > 0


def test_an_edit_with_a_mask_as_urls_and_extra_fields(client):
    mask = png(mode="RGBA", color=(0, 0, 0, 0))  # all transparent: repaint everything
    result = client.images.edit(
        model=EDIT,
        image=("cat.png", png(), "image/png"),
        mask=("mask.png", mask, "image/png"),
        prompt="a hat",
        n=2,
        response_format="url",
        extra_body={"seed": 7, "strength": 0.5},
    )
    assert len(result.data) == 2 and [item.model_dump().get("seed") for item in result.data] == [7, 8]
    for item in result.data:
        got = httpx.get(item.url, headers={"Authorization": "Bearer sk-alice"}, timeout=30)
        assert got.status_code == 200 and image_of(got.content).format == "PNG"


def test_an_edit_of_several_pictures_sends_them_as_image_array_parts(client, stack):
    one = client.images.edit(model=MULTI, image=("a.png", png(), "image/png"), prompt="x")
    two = client.images.edit(
        model=MULTI,
        image=[("a.png", png(), "image/png"), ("b.png", png((40, 24), color="blue"), "image/png")],
        prompt="put the cat of picture 1 on the sofa of picture 2",
        response_format="b64_json",
    )
    assert len(one.data) == 1 and image_of(base64.b64decode(two.data[0].b64_json)).format == "PNG"
    with pytest.raises(openai.APIStatusError) as e:
        client.images.edit(
            model=MULTI,
            image=[("a.png", png(), "image/png")] * 3,  # the workflow takes two
            prompt="x",
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "image", e.value.body
    assert MULTI in e.value.body["message"]
    models = {m.id: m.model_dump() for m in client.models.list().data}
    assert models[MULTI]["capabilities"] == ["edit"]


def test_bad_edits_are_4xx_naming_the_field(client):
    cases = [
        (dict(model=WORKFLOW, image=("a.png", png(), "image/png")), 400, "model"),  # takes no image
        (dict(model=EDIT, image=("a.png", b"not an image", "image/png")), 422, "image"),
        (dict(model=EDIT, image=("a.txt", png(), "text/plain")), 422, "image"),
        (
            dict(model=EDIT, image=("a.png", png(), "image/png"), mask=("m.png", png((16, 16)), "image/png")),
            422,
            "mask",
        ),
    ]
    for kwargs, status, param in cases:
        with pytest.raises(openai.APIStatusError) as e:
            client.images.edit(prompt="x", **kwargs)
        assert e.value.status_code == status and e.value.body["param"] == param, (kwargs, e.value.body)
    # The gateway keeps serving.
    ok = client.images.edit(model=EDIT, image=("a.png", png(), "image/png"), prompt="x")
    assert len(ok.data) == 1
