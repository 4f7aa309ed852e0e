"""End to end: gateway, registry, scheduler and two executors as separate processes over real NATS
and Redis; the PNG that comes back over HTTP equals the monolithic diffusers FluxPipeline's image.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import threading
import uuid
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import redis
from PIL import Image

from libs.launcher.__main__ import curl_command
from libs.launcher.stack import Stack
from libs.models.flux_workflows import tiny_flux
from libs.protocol.keys import Keys
from libs.workflow.spec import encode_spec
from tests.conftest import cleanup_namespace, free_port
from tests.support import plugin_flux
from tests.support.waiting import until_sync

pytestmark = pytest.mark.e2e
KEY = "sk-e2e"
OTHER = "sk-other"


def start_stack(broker_urls, models: Path, log_dir: Path, **kw) -> Stack:
    nats_url, redis_url = broker_urls
    stack = Stack(
        namespace="t" + uuid.uuid4().hex[:10],
        log_dir=log_dir,
        model_root=models,
        gateway_port=free_port(),
        executors=2,
        api_keys=f"{KEY}=e2e:admin,{OTHER}=other",
        nats_url=nats_url,
        redis_url=redis_url,
        **kw,
    )
    stack.start()
    status, body = stack.http("POST", "/v1/workflows", json.loads(encode_spec(tiny_flux())), key=KEY)
    assert status == 201, body
    return stack


def stop_stack(stack: Stack, broker_urls) -> None:
    stack.stop()
    asyncio.run(cleanup_namespace(*broker_urls, stack.namespace))


@pytest.fixture(scope="module")
def stack(broker_urls, tiny_models, tmp_path_factory):
    s = start_stack(broker_urls, tiny_models, tmp_path_factory.mktemp("logs"))
    yield s
    stop_stack(s, broker_urls)


@cache
def _pipeline(models: Path):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(models / "tiny-flux")


def monolithic(models: Path, prompt: str, seed: int, steps: int, width: int, height: int) -> np.ndarray:
    """The reference: the whole diffusers pipeline in this process, same components and seed."""
    import torch

    torch.set_num_threads(1)  # executors run with 1 thread; the thread count changes the bits
    pipe = _pipeline(models)
    with torch.no_grad():
        image = pipe(
            prompt,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=3.5,
            generator=torch.Generator().manual_seed(seed),
            max_sequence_length=64,
        ).images[0]
    return np.array(image)


def pixels(b64: str) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(base64.b64decode(b64))))


def request_state(stack: Stack, rid: str) -> dict[str, str]:
    r = redis.Redis.from_url(stack.redis_url)
    try:
        return {k.decode(): v.decode() for k, v in r.hgetall(Keys(stack.namespace).request(rid)).items()}
    finally:
        r.close()


def generate(stack: Stack, key: str = KEY, **fields) -> tuple[int, dict]:
    return stack.http("POST", "/v1/images/generations", {"model": "tiny-flux", **fields}, key=key)


def test_the_png_equals_the_monolithic_flux_pipeline_bitwise_and_tensors_crossed_executors(
    stack, tiny_models
):
    status, body = generate(
        stack, prompt="a lighthouse at dusk", seed=7, num_inference_steps=4, size="128x64"
    )
    assert status == 200, (body, stack.tail("scheduler"))
    got = pixels(body["data"][0]["b64_json"])
    want = monolithic(tiny_models, "a lighthouse at dusk", seed=7, steps=4, width=128, height=64)
    assert got.shape == (64, 128, 3) and want.std() > 0
    assert np.array_equal(got, want)
    state = request_state(stack, f"{body['id']}-0")
    assert state["status"] == "succeeded"
    assert sorted(state["executors"].split(",")) == sorted(
        f"{stack.namespace}-executor-{i}" for i in range(2)
    )
    assert int(state["bytes_moved"]) > 0  # some node pulled an input from the other executor's arena
    assert int(state["nodes_done"]) == int(state["nodes_total"]) == 2 + 1 + 2 * 4 + 1


def test_n_images_get_consecutive_seeds_and_each_equals_the_pipeline(stack, tiny_models):
    status, body = generate(stack, prompt="two boats", seed=11, n=2, num_inference_steps=2, size="64x64")
    assert status == 200, body
    assert [d["seed"] for d in body["data"]] == [11, 12]
    for i, item in enumerate(body["data"]):
        want = monolithic(tiny_models, "two boats", seed=11 + i, steps=2, width=64, height=64)
        assert np.array_equal(pixels(item["b64_json"]), want)
    assert not np.array_equal(pixels(body["data"][0]["b64_json"]), pixels(body["data"][1]["b64_json"]))


def test_url_responses_serve_the_png_to_its_tenant_only(stack):
    status, body = generate(stack, prompt="a kite", seed=3, num_inference_steps=1, response_format="url")
    assert status == 200, body
    url = body["data"][0]["url"]
    import urllib.error
    import urllib.request

    path = url.split(str(stack.gateway_port), 1)[1]
    req = urllib.request.Request(stack.url + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"] == "image/png"
        assert Image.open(io.BytesIO(r.read())).size == (128, 128)
    req = urllib.request.Request(stack.url + path, headers={"Authorization": f"Bearer {OTHER}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 404


def test_the_readme_curl_command_returns_another_image(stack, tiny_models, tmp_path):
    from libs.trained import catalog  # the launcher's example asks the trained flux-shapes model

    catalog.install(tiny_models)
    spec = json.loads(encode_spec(catalog.flux_shapes()))
    assert stack.http("POST", "/v1/workflows", spec, key=KEY)[0] in (200, 201)
    cmd = curl_command(stack.url, str(tmp_path)).replace("sk-t2i-dev", KEY)
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    img = Image.open(tmp_path / "squares.png")
    assert img.size == (64, 64) and img.format == "PNG"


def test_bad_requests_between_good_ones_disturb_nothing(stack):
    results: list[int] = []

    def good() -> None:
        results.append(generate(stack, prompt="steady", seed=1, num_inference_steps=3)[0])

    t = threading.Thread(target=good)
    t.start()
    for body in ({"prompt": "x", "n": 0}, {"prompt": "x", "size": "7x7"}, {"prompt": 5}):
        assert generate(stack, **body)[0] == 422
    assert stack.http("POST", "/v1/images/generations", None, key="wrong")[0] == 401
    t.join(120)
    assert results == [200]
    assert all(p.poll() is None for p in stack.procs.values())


def test_an_executor_killed_mid_request_still_returns_the_same_image(broker_urls, tiny_models, tmp_path):
    stack = start_stack(broker_urls, tiny_models, tmp_path / "logs")
    try:
        out: dict = {}

        def call() -> None:
            out["resp"] = generate(stack, prompt="resilient", seed=5, num_inference_steps=24, size="256x256")

        t = threading.Thread(target=call)
        t.start()
        rid = None

        def under_way_on_both() -> bool:  # the request, once it is under way on both executors
            nonlocal rid
            r = redis.Redis.from_url(stack.redis_url)
            try:
                keys = [k.decode() for k in r.scan_iter(match=Keys(stack.namespace).request("*"))]
            finally:
                r.close()
            if not keys:
                return False
            rid = keys[0].rsplit(":", 1)[1]
            state = request_state(stack, rid)
            return int(state.get("nodes_done", 0)) >= 6 and "," in state.get("executors", "")

        assert until_sync(under_way_on_both, 60, step=0.05), (rid, stack.tail("scheduler"))
        stack.kill("executor-1")
        t.join(180)
        status, body = out["resp"]
        assert status == 200, (body, stack.tail("scheduler"))
        state = request_state(stack, rid)
        # Lineage re-execution: the same attempt, only what was lost (and what rebuilds it) re-run.
        assert int(state["attempt"]) == 1 and float(state["rerun_s"]) > 0, state
        assert float(state["rerun_s"]) < float(state["gpu_s"]), state  # not the whole request again
        want = monolithic(tiny_models, "resilient", seed=5, steps=24, width=256, height=256)
        assert np.array_equal(pixels(body["data"][0]["b64_json"]), want)
        assert "re-runs" in stack.read_log("scheduler") and "restarting request" not in stack.read_log(
            "scheduler"
        )
    finally:
        stop_stack(stack, broker_urls)


def test_a_user_workflow_with_a_plugin_modelfn_is_registered_with_the_sdk_and_generates(stack, tiny_models):
    from libs.sdk import SDKError, generate, register
    from libs.workflow import catalog

    invert = catalog.load_class(plugin_flux.PLUGIN)  # a user's package, found through its entry point
    assert invert.__module__ == "t2i_example.fns"
    wf = plugin_flux.inverted_flux()
    stored = register(wf, base_url=stack.url, api_key=KEY)
    assert stored["created"] and stored["workflow"]["version"] == 1
    (png,) = generate("inverted-flux", "a red fox", base_url=stack.url, api_key=KEY, seed=3)
    want = monolithic(tiny_models, "a red fox", seed=3, steps=2, width=64, height=64)
    assert np.array_equal(np.array(Image.open(io.BytesIO(png))), 255 - want)
    # A spec naming a ModelFn no executor has is refused with the problem named.
    bad = wf.spec()
    bad.body[0].fn = "example.missing"
    with pytest.raises(SDKError) as e:
        register(bad, base_url=stack.url, api_key=KEY)
    assert e.value.status == 422 and e.value.param == "body[0].fn" and "unknown ModelFn" in e.value.message
