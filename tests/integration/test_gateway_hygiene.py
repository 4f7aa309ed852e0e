"""Gateway hygiene with a real registry behind it (real NATS and Redis), no executors: malformed
bodies are 400 and never 500, limits are 413, LoRA paths stay private and inside the model root,
control images are decoded off the event loop within a pixel bound, and every error says whether a
retry could help.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from libs.common.nats_conn import connect
from libs.models.flux_workflows import tiny_flux
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects
from libs.workflow import catalog
from libs.workflow.spec import encode_spec
from services.gateway import inputs
from services.gateway.app import make_app
from services.gateway.auth import ApiKeys
from services.gateway.body import BUS_PAYLOAD_LIMIT, MAX_DEPTH
from services.gateway.config import GatewayConfig
from services.gateway.results import redact
from services.registry.service import RegistryService
from services.registry.store import WorkflowStore
from tests.integration.test_gateway_api import adapter_workflow
from tests.support.waiting import until

USER = {"Authorization": "Bearer sk-user"}
BOB = {"Authorization": "Bearer sk-bob"}
ADMIN = {"Authorization": "Bearer sk-admin"}
ROUTES = ("/v1/images/generations", "/v1/workflows", "/v1/loras")


@pytest.fixture
async def api(common, request):
    cfg = getattr(request, "param", None) or GatewayConfig(max_n=4)
    nc = await connect(common.nats_url, "test-registry")
    redis = Redis.from_url(common.redis_url)
    registry = RegistryService(
        nc, WorkflowStore(redis, Keys(common.namespace)), catalog.signatures(), Subjects(common.namespace)
    )
    await registry.start()
    app = make_app(cfg, common, ApiKeys.load("sk-user=alice,sk-bob=bob,sk-admin=ops:admin"))
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    for spec in (json.loads(encode_spec(tiny_flux())), adapter_workflow()):
        resp = await client.post("/v1/workflows", json=spec, headers=ADMIN)
        assert resp.status == 201, await resp.text()
    yield client, nc, common, registry
    await client.close()
    await registry.stop()
    await nc.close()
    await redis.aclose()


async def error_of(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def nested(depth: int, leaf: str = "1") -> bytes:
    return ('{"a":' * depth + leaf + "}" * depth).encode()


MALFORMED = {
    "5000-digit integer": b'{"model": "tiny-flux", "prompt": "x", "seed": ' + b"9" * 5000 + b"}",
    "1e999": b'{"model": "tiny-flux", "prompt": "x", "guidance_scale": 1e999}',
    "NaN": b'{"model": "tiny-flux", "prompt": "x", "guidance_scale": NaN}',
    "Infinity": b'{"model": "tiny-flux", "prompt": "x", "guidance_scale": Infinity}',
    "-Infinity": b'{"model": "tiny-flux", "prompt": "x", "guidance_scale": -Infinity}',
    "1000 nested arrays": b"[" * 1000 + b"]" * 1000,
    "1000 nested objects": nested(1000),
    "100k nested arrays": b"[" * 100_000 + b"]" * 100_000,
    "nesting past the limit": nested(MAX_DEPTH + 1),
    "invalid UTF-8 in a string": b'{"model": "tiny-flux", "prompt": "\xff\xfe"}',
    "invalid UTF-8 in a key": b'{"\xc3\x28": 1}',
    "a lone surrogate": b'{"model": "tiny-flux", "prompt": "\\ud800"}',
    "a byte-order mark": b'\xef\xbb\xbf{"model": "tiny-flux", "prompt": "x"}',
    "a top-level array": b'[{"model": "tiny-flux"}]',
    "a top-level string": b'"tiny-flux"',
    "a top-level number": b"42",
    "a top-level null": b"null",
    "a top-level true": b"true",
    "whitespace only": b" \n\t ",
    "empty": b"",
    "truncated": b'{"model": "tiny-flux", "prompt": "x',
    "trailing garbage": b'{"model": "tiny-flux", "prompt": "x"} {}',
}


@pytest.mark.parametrize("route", ROUTES)
async def test_every_malformed_body_gets_400_never_500(api, route):
    client, _, _, _ = api
    for what, raw in MALFORMED.items():
        resp = await client.post(route, data=raw, headers=ADMIN)
        err = await error_of(resp, 400)
        assert err["code"] == "invalid_json", (what, err)
        assert resp.headers["x-should-retry"] == "false", what
    assert (await client.get("/v1/workflows", headers=USER)).status == 200  # still serving


async def test_nesting_within_the_limit_is_a_well_formed_body_with_wrong_values(api):
    client, _, _, _ = api
    body = {"model": "tiny-flux", "prompt": "x", "params": json.loads(nested(MAX_DEPTH - 2))}
    err = await error_of(await client.post("/v1/images/generations", json=body, headers=USER), 422)
    assert err["param"] == "params.a"


async def test_bodies_and_prompts_beyond_the_bus_limit_get_413(api):
    client, nc, common, _ = api
    prompt = "x" * (BUS_PAYLOAD_LIMIT + 1)
    err = await error_of(
        await client.post(
            "/v1/images/generations", json={"model": "tiny-flux", "prompt": prompt}, headers=USER
        ),
        413,
    )
    assert err["param"] == "prompt" and "512 KiB" in err["message"]
    # A workflow whose string parameter has no length bound: the bus-bound request itself is measured.
    spec = {**adapter_workflow(), "name": "with-caption"}
    spec["params"]["caption"] = {"type": "str", "default": ""}
    assert (await client.post("/v1/workflows", json=spec, headers=ADMIN)).status == 201, spec
    control = png_b64(16, 16)
    params = {"control_image": control, "caption": "y" * BUS_PAYLOAD_LIMIT}
    body = {"model": "with-caption", "prompt": "x", "params": params}
    err = await error_of(await client.post("/v1/images/generations", json=body, headers=USER), 413)
    assert err["param"] == "params"
    big_spec = {**json.loads(encode_spec(tiny_flux())), "description": "d" * BUS_PAYLOAD_LIMIT}
    await error_of(await client.post("/v1/workflows", json=big_spec, headers=ADMIN), 413)
    big_lora = {"name": "big", "path": "a.safetensors", "description": "d" * BUS_PAYLOAD_LIMIT}
    await error_of(await client.post("/v1/loras", json=big_lora, headers=ADMIN), 413)
    info = await nc.jetstream().stream_info(Subjects(common.namespace).intake_stream)
    assert info.state.messages == 0
    # A generation body may carry control images beyond the bus limit: they go through the object store.
    junk = base64.b64encode(b"z" * (BUS_PAYLOAD_LIMIT * 2)).decode()
    body = {"model": "with-adapters", "prompt": "x", "params": {"control_image": junk}}
    err = await error_of(await client.post("/v1/images/generations", json=body, headers=USER), 422)
    assert err["param"] == "params.control_image"


async def test_names_too_long_for_the_bus_are_unknown_not_a_failure(api):
    client, _, _, _ = api
    long = "m" * (2 << 20)  # within the generation body limit, beyond NATS' payload limit
    err = await error_of(
        await client.post("/v1/images/generations", json={"model": long, "prompt": "x"}, headers=USER), 404
    )
    assert err["param"] == "model" and len(err["message"]) < 200
    body = {
        "model": "with-adapters",
        "prompt": "x",
        "params": {"control_image": png_b64(16, 16), "lora": long},
    }
    err = await error_of(await client.post("/v1/images/generations", json=body, headers=USER), 422)
    assert err["param"] == "params.lora" and "unknown LoRA" in err["message"]


async def test_errors_say_whether_a_retry_could_help(api):
    client, _, _, registry = api
    cases = [
        (client.post("/v1/images/generations", json={"prompt": "x"}), 401),
        (client.post("/v1/workflows", json={}, headers=USER), 403),
        (client.get("/v1/nothing", headers=USER), 404),
        (client.delete("/v1/workflows", headers=USER), 405),
        (client.post("/v1/images/generations", json={"model": "tiny-flux", "n": 0}, headers=USER), 422),
        (client.post("/v1/images/generations", data=b"{", headers=USER), 400),
    ]
    for call, status in cases:
        resp = await call
        assert resp.status == status and resp.headers["x-should-retry"] == "false", (status, resp.headers)
    ok = await client.get("/v1/workflows", headers=USER)
    assert ok.status == 200 and "x-should-retry" not in ok.headers
    await registry.stop()  # the registry goes away: 503, worth retrying
    resp = await client.get("/v1/workflows", headers=USER)
    assert resp.status == 503 and resp.headers["x-should-retry"] == "true" and resp.headers["Retry-After"]


@pytest.mark.parametrize("api", [GatewayConfig(tenant_inflight=1, request_timeout_s=30)], indirect=True)
async def test_a_tenant_beyond_its_in_flight_limit_gets_429_with_retry_after_and_others_are_admitted(api):
    client, _, _, _ = api
    body = {"model": "tiny-flux", "prompt": "x", "size": "128x128"}

    async def in_flight(count: int) -> bool:
        return f"t2i_gateway_inflight {count}" in await (await client.get("/metrics")).text()

    waiting = asyncio.create_task(client.post("/v1/images/generations", json=body, headers=USER))
    # No executor runs here: the call stays in flight.
    assert await until(lambda: in_flight(1), 10), "alice's call never got in flight"
    resp = await client.post("/v1/images/generations", json=body, headers=USER)
    err = await error_of(resp, 429)
    assert err["code"] == "tenant_busy" and err["type"] == "rate_limit_error"
    assert int(resp.headers["Retry-After"]) >= 1 and resp.headers["x-should-retry"] == "true"
    other = asyncio.create_task(client.post("/v1/images/generations", json=body, headers=BOB))
    assert await until(lambda: in_flight(2), 10), "bob's call was not admitted beside alice's"
    assert 't2i_gateway_tenant_inflight{tenant="bob"} 1' in await (await client.get("/metrics")).text()
    err = await error_of(await client.post("/v1/images/generations", json={**body, "n": 2}, headers=BOB), 422)
    assert err["param"] == "n"  # more than a tenant may ever have in flight
    for t in (waiting, other):
        t.cancel()


async def test_lora_paths_that_are_absolute_or_leave_the_model_root_are_refused(api):
    client, _, _, _ = api
    for path in (
        "/etc/passwd.safetensors",
        "\\\\server\\share\\a.safetensors",
        "C:\\loras\\a.safetensors",
        "~/a.safetensors",
        "../a.safetensors",
        "loras/../../a.safetensors",
        "loras\\..\\..\\a.safetensors",
        "loras/a\x00.safetensors",
    ):
        err = await error_of(
            await client.post("/v1/loras", json={"name": "x", "path": path}, headers=ADMIN), 422
        )
        assert err["param"] == "path", (path, err)
    listed = await (await client.get("/v1/loras", headers=USER)).json()
    assert listed["data"] == []  # none reached the registry


async def test_no_response_shows_a_loras_path(api):
    client, _, _, _ = api
    path = "loras/secret-dir/style-a.safetensors"
    lora = {"name": "style-a", "path": path, "description": "watercolour"}
    texts = []
    resp = await client.post("/v1/loras", json=lora, headers=ADMIN)
    assert resp.status == 201
    texts.append(await resp.text())
    for url in ("/v1/loras", "/v1/loras/style-a"):
        for who in (USER, ADMIN):
            resp = await client.get(url, headers=who)
            assert resp.status == 200
            texts.append(await resp.text())
    assert all("secret-dir" not in t and "safetensors" not in t for t in texts), texts
    assert json.loads(texts[1])["data"] == [
        {"object": "lora", "name": "style-a", "description": "watercolour"}
    ]
    await error_of(await client.get("/v1/loras/nope", headers=USER), 404)
    # an executor's error text names the LoRA, never its file
    text = redact(f"cannot open /srv/models/{path}: no such file; also {path}", {path: "style-a"})
    assert "secret-dir" not in text and "/srv" not in text and "<lora style-a>" in text


def png_b64(width: int, height: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


async def test_control_images_are_decoded_off_the_event_loop_within_a_pixel_bound(api, monkeypatch):
    client, _, _, _ = api
    threads: list[threading.Thread] = []
    decode = inputs.decode_image

    def spy(field: str, value: str) -> bytes:
        threads.append(threading.current_thread())
        return decode(field, value)

    monkeypatch.setattr(inputs, "decode_image", spy)
    side = int((inputs.MAX_PIXELS + 1) ** 0.5) + 1  # each side within MAX_SIDE, the area beyond the bound
    assert side <= inputs.MAX_SIDE
    body = {"model": "with-adapters", "prompt": "x", "params": {"control_image": png_b64(side, side)}}
    err = await error_of(await client.post("/v1/images/generations", json=body, headers=USER), 422)
    assert err["param"] == "params.control_image" and "pixels" in err["message"]
    assert threads and all(t is not threading.main_thread() for t in threads)
