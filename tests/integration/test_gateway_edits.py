"""``POST /v1/images/edits`` at the gateway (``services/gateway/edits.py``): the multipart form read
and checked field by field, the uploads stored as the workflow's ``image``/``mask`` parameters (the
mask turned into the workflows' convention), and every bad input a 4xx naming its field, with
nothing reaching the intake and the gateway serving on. A registry runs in the test's loop; no
scheduler is needed (the intake stream is read directly)."""

from __future__ import annotations

import io
import json

import pytest
from aiohttp import FormData
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image
from redis.asyncio import Redis

from libs.common.jetstream import ensure_images_bucket
from libs.common.nats_conn import connect
from libs.protocol.keys import Keys
from libs.protocol.messages import ImageRequest, intake_decoder
from libs.protocol.subjects import Subjects
from libs.sim.workflows import sim_workflow
from libs.workflow import catalog
from libs.workflow.spec import encode_spec
from services.gateway.app import make_app
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.registry.service import RegistryService
from services.registry.store import WorkflowStore

USER = {"Authorization": "Bearer sk-user"}
ADMIN = {"Authorization": "Bearer sk-admin"}


def workflow(name: str, *, image: bool = True, mask: bool = True) -> dict:
    spec = json.loads(encode_spec(sim_workflow(name, "x", steps=1)))
    if image:
        spec["params"]["image"] = {"type": "image", "required": True}
    if mask:
        spec["params"]["mask"] = {"type": "image"}
    spec["params"]["strength"] = {"type": "float", "default": 0.8, "minimum": 0.0, "maximum": 1.0}
    return spec


def png(size=(32, 24), mode="RGB", color: object = "red") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def form(*, image: bytes | None = None, mask: bytes | None = None, ctype="image/png", **fields) -> FormData:
    data = FormData(default_to_multipart=True)
    for name, value in {"model": "editor", "prompt": "a hat", **fields}.items():
        data.add_field(name, str(value))
    if image is not None:
        data.add_field("image", image, filename="in.png", content_type=ctype)
    if mask is not None:
        data.add_field("mask", mask, filename="mask.png", content_type="image/png")
    return data


@pytest.fixture
async def api(common):
    nc = await connect(common.nats_url, "test-registry")
    redis = Redis.from_url(common.redis_url)
    subjects = Subjects(common.namespace)
    registry = RegistryService(
        nc, WorkflowStore(redis, Keys(common.namespace)), catalog.signatures(), subjects
    )
    await registry.start()
    app = make_app(GatewayConfig(max_n=4), common, ApiKeys.load("sk-user=alice,sk-admin=ops:admin"))
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    for spec in (
        workflow("editor"),
        workflow("whole", mask=False),
        workflow("plain", image=False, mask=False),
    ):
        assert (await client.post("/v1/workflows", json=spec, headers=ADMIN)).status == 201
    yield client, nc, subjects
    await client.close()
    await registry.stop()
    await nc.close()
    await redis.aclose()


async def error_of(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    return (await resp.json())["error"]


async def intake(nc, subjects) -> list[ImageRequest]:
    js = nc.jetstream()
    info = await js.stream_info(subjects.intake_stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        msg = await js.get_msg(subjects.intake_stream, seq)
        out.append(intake_decoder.decode(msg.data))
    return out


async def test_an_edit_stores_the_image_and_the_mask_as_the_workflows_take_them(api):
    client, nc, subjects = api
    mask = Image.new("RGBA", (32, 24), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 16, 24))  # the left half transparent: repaint it
    buf = io.BytesIO()
    mask.save(buf, format="PNG")
    resp = await client.post(
        "/v1/images/edits",
        data=form(image=png(), mask=buf.getvalue(), n=2, seed=3, strength=0.5),
        headers={**USER, "Prefer": "respond-async"},
    )
    assert resp.status == 202, await resp.text()
    reqs = await intake(nc, subjects)
    assert len(reqs) == 2 and [r.params["seed"] for r in reqs] == [3, 4]
    params = reqs[0].params
    assert params["strength"] == 0.5 and params["image"].endswith("/image.png")
    assert params["mask"].endswith("/mask.png") and reqs[1].params["mask"] == params["mask"]
    images = await ensure_images_bucket(nc.jetstream(), subjects)
    stored = Image.open(io.BytesIO((await images.get(params["mask"])).data)).convert("L")
    assert stored.size == (32, 24)
    assert stored.getpixel((0, 0)) == 255 and stored.getpixel((31, 0)) == 0  # white repaints
    picture = Image.open(io.BytesIO((await images.get(params["image"])).data))
    assert picture.size == (32, 24) and picture.convert("RGB").getpixel((5, 5)) == (255, 0, 0)


async def test_bad_edits_get_4xx_naming_the_field_and_reach_nothing(api):
    client, nc, subjects = api
    huge = png() + b"\0" * (50 << 20)  # a 50 MB upload: refused at the limit
    cases = [
        (form(image=png(), model="plain"), 400, "model", "takes no image"),
        (form(image=png(), model="whole", mask=png()), 400, "mask", "takes no mask"),
        (form(), 422, "image", "is required"),
        (form(image=b"GIF89a not really"), 422, "image", "not a readable image"),
        (form(image=png(), ctype="text/plain"), 422, "image", "must be an image file"),
        (form(image=png(), mask=png((16, 16))), 422, "mask", "must be the size of the image"),
        (form(image=png((4, 4))), 422, "image", "each side must be"),
        (form(image=huge), 413, "image", "too large"),
        (form(image=png(), n="two"), 422, "n", "must be an integer"),
        (form(image=png(), strength="lots"), 422, "strength", "must be a number"),
        (form(image=png(), colour="blue"), 422, "colour", "unknown field"),
        (form(image=png(), model="nope"), 404, "model", "not found"),
    ]
    for data, status, param, fragment in cases:
        err = await error_of(await client.post("/v1/images/edits", data=data, headers=USER), status)
        assert err["param"] == param and fragment in err["message"], (param, err)
    not_a_form = await client.post("/v1/images/edits", json={"model": "editor"}, headers=USER)
    assert (await error_of(not_a_form, 415))["code"] == "invalid_content_type"
    assert await intake(nc, subjects) == []  # nothing bad reached the scheduler
    ok = await client.post(
        "/v1/images/edits", data=form(image=png()), headers={**USER, "Prefer": "respond-async"}
    )
    assert ok.status == 202  # and the gateway serves on


async def test_models_say_what_each_workflow_can_do(api):
    client, _, _ = api
    listed = await (await client.get("/v1/models", headers=USER)).json()
    caps = {m["id"]: m["capabilities"] for m in listed["data"]}
    assert caps == {"editor": ["edit", "inpaint"], "whole": ["edit"], "plain": ["generate"]}
    one = await (await client.get("/v1/models/whole", headers=USER)).json()
    assert one["capabilities"] == ["edit"]
