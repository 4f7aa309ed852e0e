"""The gateway's HTTP API with a real registry behind it (real NATS and Redis): auth and bad input.

No executor runs here: every case is refused before anything reaches the scheduler, which the
last test checks by counting the intake stream's messages.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from libs.common.nats_conn import connect
from libs.models.flux_workflows import tiny_flux
from libs.protocol.keys import Keys
from libs.protocol.messages import RequestResult, encode
from libs.protocol.subjects import Subjects
from libs.workflow import catalog
from libs.workflow.spec import encode_spec
from services.gateway.app import make_app
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.records import GenerationRecord, Records
from services.registry.service import RegistryService
from services.registry.store import WorkflowStore

USER = {"Authorization": "Bearer sk-user"}
ADMIN = {"Authorization": "Bearer sk-admin"}


@pytest.fixture
async def api(common):
    nc = await connect(common.nats_url, "test-registry")
    redis = Redis.from_url(common.redis_url)
    registry = RegistryService(
        nc, WorkflowStore(redis, Keys(common.namespace)), catalog.signatures(), Subjects(common.namespace)
    )
    await registry.start()
    keys = ApiKeys.load("sk-user=alice,sk-admin=ops:admin")
    app = make_app(GatewayConfig(max_n=4), common, keys)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    resp = await client.post("/v1/workflows", json=json.loads(encode_spec(tiny_flux())), headers=ADMIN)
    assert resp.status == 201, await resp.text()
    yield client, nc, common
    await client.close()
    await registry.stop()
    await nc.close()
    await redis.aclose()


async def error_of(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def gen(**fields) -> dict:
    return {"model": "tiny-flux", "prompt": "a cat", **fields}


async def test_a_missing_or_unknown_api_key_gets_401(api):
    client, _, _ = api
    err = await error_of(await client.post("/v1/images/generations", json=gen()), 401)
    assert err["code"] == "missing_api_key"
    err = await error_of(
        await client.post("/v1/images/generations", json=gen(), headers={"Authorization": "Bearer nope"}), 401
    )
    assert err["code"] == "invalid_api_key"
    await error_of(await client.get("/v1/workflows", headers={"Authorization": "Basic abc"}), 401)


async def test_malformed_json_and_non_object_bodies_get_400(api):
    client, _, _ = api
    for raw in (b"{not json", b"", b"[1,2]", b'"text"', b"\xff\xfe"):
        err = await error_of(await client.post("/v1/images/generations", data=raw, headers=USER), 400)
        assert err["code"] == "invalid_json"


async def test_an_unknown_workflow_gets_404_naming_model(api):
    client, _, _ = api
    err = await error_of(
        await client.post("/v1/images/generations", json=gen(model="nope"), headers=USER), 404
    )
    assert err["param"] == "model" and "nope" in err["message"]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": "a cat"}, "model", "required"),
        ({"model": 5, "prompt": "a cat"}, "model", "non-empty string"),
        ({"model": "tiny-flux"}, "prompt", "required"),
        (gen(prompt=""), "prompt", "non-empty"),
        (gen(prompt=["a", "b"]), "prompt", "string"),
        (gen(size="1024x1024"), "size", "not supported"),
        (gen(size=256), "size", "string"),
        (gen(n=0), "n", "between 1 and 4"),
        (gen(n=5), "n", "between 1 and 4"),
        (gen(n="2"), "n", "integer"),
        (gen(n=1.5), "n", "integer"),
        (gen(seed="x"), "seed", "integer"),
        (gen(seed=-1), "seed", "between 0"),
        (gen(num_inference_steps=0), "num_inference_steps", "at least 1"),
        (gen(num_inference_steps=1000), "num_inference_steps", "at most 100"),
        (gen(num_inference_steps="4"), "num_inference_steps", "integer"),
        (gen(guidance_scale="high"), "guidance_scale", "number"),
        (gen(response_format="jpeg"), "response_format", "one of"),
        (gen(colour="blue"), "colour", "unknown field"),
        (gen(params={"max_sequence_length": 9999}), "params.max_sequence_length", "at most 512"),
        (gen(params={"nope": 1}), "params.nope", "not a parameter"),
        (gen(params={"seed": 1}), "params.seed", "top-level"),
        (gen(params={"width": 64}), "params.width", "top-level"),
        (gen(params=[1]), "params", "object"),
        (gen(user=5), "user", "string"),
    ],
)
async def test_bad_fields_get_422_naming_the_field(api, body, param, fragment):
    client, _, _ = api
    err = await error_of(await client.post("/v1/images/generations", json=body, headers=USER), 422)
    assert err["param"] == param and fragment in err["message"], err


async def test_registration_needs_an_admin_key_and_bad_specs_list_their_problems(api):
    client, _, _ = api
    spec = json.loads(encode_spec(tiny_flux()))
    err = await error_of(await client.post("/v1/workflows", json=spec, headers=USER), 403)
    assert err["code"] == "forbidden"
    spec["body"][0]["fn"] = "flux.nope"
    err = await error_of(await client.post("/v1/workflows", json=spec, headers=ADMIN), 422)
    assert err["param"] == "body[0].fn" and err["problems"][0]["path"] == "body[0].fn"
    await error_of(await client.post("/v1/workflows", data=b"{", headers=ADMIN), 400)


async def test_workflows_can_be_listed_and_looked_up(api):
    client, _, _ = api
    resp = await client.get("/v1/workflows", headers=USER)
    assert resp.status == 200
    (wf,) = (await resp.json())["data"]
    assert wf["name"] == "tiny-flux" and wf["version"] == 1 and "128x128" in wf["sizes"]
    resp = await client.get("/v1/workflows/tiny-flux", headers=USER)
    assert (await resp.json())["workflow"]["body"][0]["fn"] == "flux.clip_encoder"
    await error_of(await client.get("/v1/workflows/nope", headers=USER), 404)
    await error_of(await client.get("/v1/workflows/tiny-flux?version=x", headers=USER), 422)


async def test_health_readiness_metrics_and_unknown_routes(api):
    client, _, _ = api
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 200
    assert "t2i_gateway_inflight 0" in await (await client.get("/metrics")).text()
    err = await error_of(await client.get("/v1/nothing", headers=USER), 404)
    assert "no route" in err["message"]
    await error_of(await client.delete("/v1/workflows", headers=USER), 405)


async def test_refused_requests_never_reach_the_intake(api):
    client, nc, common = api
    for body in (gen(n=0), gen(size="1x1"), {"model": "tiny-flux"}):
        assert (await client.post("/v1/images/generations", json=body, headers=USER)).status == 422
    info = await nc.jetstream().stream_info(Subjects(common.namespace).intake_stream)
    assert info.state.messages == 0


async def test_an_oversized_body_gets_413_and_the_gateway_keeps_serving(api):
    client, _, _ = api
    huge = b'{"model": "tiny-flux", "prompt": "' + b"x" * (9 << 20) + b'"}'
    err = await error_of(await client.post("/v1/images/generations", data=huge, headers=USER), 413)
    assert "too large" in err["message"]
    assert (await client.get("/v1/workflows", headers=USER)).status == 200


def adapter_workflow() -> dict:
    """A workflow with the adapter parameters of the catalog: a control image and a LoRA."""
    from libs.sim.workflows import sim_workflow

    spec = json.loads(encode_spec(sim_workflow("with-adapters", "x", steps=1)))
    spec["params"]["control_image"] = {"type": "image", "required": True}
    spec["params"]["lora"] = {"type": "lora", "default": ""}
    return spec


async def test_loras_are_registered_by_admins_and_checked(api):
    client, _, _ = api
    good = {"name": "style-a", "path": "loras/style-a.safetensors", "description": "test"}
    await error_of(await client.post("/v1/loras", json=good, headers=USER), 403)
    resp = await client.post("/v1/loras", json=good, headers=ADMIN)
    assert resp.status == 201 and (await resp.json())["lora"] == {
        "object": "lora",
        "name": "style-a",
        "description": "test",
    }
    assert (await client.post("/v1/loras", json=good, headers=ADMIN)).status == 200  # same name: updated
    for bad, param in [
        ({"name": "Bad Name", "path": "x.safetensors"}, "name"),
        ({"name": "ok", "path": "../../etc/passwd.safetensors"}, "path"),
        ({"name": "ok", "path": "weights.bin"}, "path"),
        ({"name": "ok"}, "path"),
        ({"name": "ok", "path": "a.safetensors", "extra": 1}, "extra"),
    ]:
        err = await error_of(await client.post("/v1/loras", json=bad, headers=ADMIN), 422)
        assert err["param"] == param, err
    listed = await (await client.get("/v1/loras", headers=USER)).json()
    assert [x["name"] for x in listed["data"]] == ["style-a"]


async def test_an_unknown_lora_or_a_control_image_that_is_not_an_image_gets_422(api):
    import base64
    import io

    from PIL import Image

    client, nc, common = api
    assert (await client.post("/v1/workflows", json=adapter_workflow(), headers=ADMIN)).status == 201
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(buf, format="PNG")
    png = base64.b64encode(buf.getvalue()).decode()
    tiny = io.BytesIO()
    Image.new("RGB", (2, 2)).save(tiny, format="PNG")

    def body(**params):
        return {"model": "with-adapters", "prompt": "x", "params": {"control_image": png, **params}}

    cases = [
        (body(lora="nope"), "params.lora", "unknown LoRA 'nope'"),
        (body(control_image="%%% not base64"), "params.control_image", "not base64"),
        (
            body(control_image=base64.b64encode(b"just some text").decode()),
            "params.control_image",
            "not a readable image",
        ),
        (
            body(control_image=base64.b64encode(buf.getvalue()[:40]).decode()),
            "params.control_image",
            "not a readable image",
        ),
        (
            body(control_image=base64.b64encode(tiny.getvalue()).decode()),
            "params.control_image",
            "each side must be",
        ),
        (body(control_image=5), "params.control_image", "must be an image"),
        ({"model": "with-adapters", "prompt": "x"}, "control_image", "is required"),
    ]
    for b, param, fragment in cases:
        err = await error_of(await client.post("/v1/images/generations", json=b, headers=USER), 422)
        assert err["param"] == param and fragment in err["message"], err
    info = await nc.jetstream().stream_info(Subjects(common.namespace).intake_stream)
    assert info.state.messages == 0  # nothing bad reached the scheduler


async def test_a_redis_burst_beyond_the_pool_waits_for_connections_instead_of_failing(common):
    from libs.common.redis_conn import connect_redis

    redis = connect_redis(common.redis_url, max_connections=4)
    try:
        key = f"{common.namespace}:burst"
        results = await asyncio.gather(*(redis.hset(key, f"f{i}", i) for i in range(200)))
        assert sum(results) == 200 and await redis.hlen(key) == 200
    finally:
        await redis.aclose()


async def test_a_request_that_ended_before_its_result_was_stored_is_looked_up_as_running(api):
    """The scheduler writes a request's final status as it ends, and its result only once the
    request's charges are written: a lookup in between answers "running" (it was a 500), and the
    stored result "succeeded" once it is there."""
    client, _, common = api
    redis = Redis.from_url(common.redis_url)
    try:
        gen_id = uuid.uuid4().hex[:20]  # the form of a generation id
        record = GenerationRecord(gen_id, "alice", "tiny-flux", 1_700_000_000, 1, "b64_json", [1], 30.0)
        await Records(redis, common.namespace).save(record)
        key = Keys(common.namespace).request(f"{gen_id}-0")
        for ended in ("succeeded", "failed", "cancelled"):
            await redis.hset(key, mapping={"status": ended})
            r = await client.get(f"/v1/requests/{gen_id}", headers=USER)
            assert r.status == 200, await r.text()
            assert (await r.json())["status"] == "running", ended
        result = RequestResult(f"{gen_id}-0", "failed", error="it broke", error_code="internal")
        await redis.hset(key, mapping={"status": "failed", "result": encode(result)})
        r = await client.get(f"/v1/requests/{gen_id}", headers=USER)
        assert r.status == 200 and (await r.json())["status"] == "failed", await r.text()
    finally:
        await redis.aclose()
