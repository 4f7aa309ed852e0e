"""The gateway in front of a running platform: looking calls up, idempotency keys, per-tenant
admission and results checked against the request that asked.

One stack per module (registry, scheduler, gateway and four simulated executors as processes, over
the real NATS and Redis, in a namespace of its own), with three workflows over a test profile:
``fast-wf`` (milliseconds), ``slow-wf`` (about 3 s: four 0.75 s denoising steps) and ``broken-wf``
(its models are not in the profile: it fails). Each tenant may have 2 images in progress.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from libs.launcher.stack import Stack
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.conftest import cleanup_namespace
from tests.support.stacks import sim_stack
from tests.support.toyprofile import write_family_profile
from tests.support.waiting import until

TENANT_INFLIGHT = 2
KEYS = "sk-alice=alice,sk-bob=bob,sk-ops=ops:admin"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_profile(path: Path) -> None:
    write_family_profile(path, {"fast": 0.002, "slow": 0.75})


def start_stack(broker_urls, tmp: Path, families: tuple[str, ...]) -> Stack:
    nats_url, redis_url = broker_urls
    write_profile(tmp / "profile.json")
    stack = sim_stack(
        tmp,
        sim_executors=4,
        sim_profile=str(tmp / "profile.json"),
        api_keys=KEYS,
        nats_url=nats_url,
        redis_url=redis_url,
        gateway_env={"T2I_GATEWAY_TENANT_INFLIGHT": str(TENANT_INFLIGHT)},
    )
    stack.start()
    try:
        for fam in families:
            spec = json.loads(encode_spec(sim_workflow(f"{fam}-wf", fam, steps=4)))
            status, body = stack.http("POST", "/v1/workflows", spec, key="sk-ops")
            assert status == 201, body
    except BaseException:
        stack.stop()
        raise
    return stack


def stop_stack(stack: Stack, broker_urls) -> None:
    stack.stop()
    asyncio.run(cleanup_namespace(*broker_urls, stack.namespace))


@pytest.fixture(scope="module")
def stack(broker_urls, tmp_path_factory) -> Iterator[Stack]:
    s = start_stack(broker_urls, tmp_path_factory.mktemp("gw-stack"), ("fast", "slow", "broken"))
    yield s
    stop_stack(s, broker_urls)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    raw: bytes
    body: dict = field(default_factory=dict)


def call(
    stack: Stack,
    method: str,
    path: str,
    body: object = None,
    *,
    key: str | None = "sk-alice",
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 60.0,
) -> Reply:
    """One HTTP call to the stack's gateway: status, headers (lower-case names) and JSON body."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.gateway_port, timeout=timeout)
    try:
        hdrs = dict(headers or {})
        if key is not None:
            hdrs["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if data is not None:
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        payload = resp.read()
        reply = Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload)
        try:
            reply.body = json.loads(payload or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            reply.body = {}
        return reply
    finally:
        conn.close()


def gen(model: str = "fast-wf", **fields) -> dict:
    return {"model": model, "prompt": "a fox", **fields}


class Intake:
    """Every ImageRequest the gateway puts on the intake (a core subscription sees JetStream's
    subject too): how many were submitted, and their ids while they run."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.ids: list[str] = []
        self.nc = None
        self._new = asyncio.Event()
        self._taken = 0
        self._stream = ""
        self._seq0 = 0  # the intake stream's last sequence number when we began

    async def __aenter__(self) -> Intake:
        import nats

        from libs.protocol.messages import intake_decoder
        from libs.protocol.subjects import Subjects

        async def on_msg(msg) -> None:
            self.ids.append(intake_decoder.decode(msg.data).request_id)
            self._new.set()

        self.nc = await nats.connect(self.stack.nats_url)
        self._stream = Subjects(self.stack.namespace).intake_stream
        await self.nc.subscribe(Subjects(self.stack.namespace).intake, cb=on_msg)
        await self.nc.flush()
        self._seq0 = await self._last_seq()
        return self

    async def _last_seq(self) -> int:
        return (await self.nc.jetstream().stream_info(self._stream)).state.last_seq

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()

    async def next_id(self, within_s: float = 20.0) -> str:
        """The first id not yet taken by this method (waiting for it if need be)."""
        deadline = time.monotonic() + within_s
        while len(self.ids) <= self._taken:
            self._new.clear()
            await asyncio.wait_for(self._new.wait(), max(0.01, deadline - time.monotonic()))
        self._taken += 1
        return self.ids[self._taken - 1]

    async def settle(self) -> int:
        """How many requests the gateway has put on the intake since we began, counted once the
        calls that made them have been answered.

        The count is the intake stream's own record, not a wait: the gateway awaits JetStream's
        acknowledgement of each request it puts on the intake (``Bridge.submit``) before the call
        goes on, and JetStream acknowledges a message once it is stored; the stream's last sequence
        number counts every message stored (taking one out of the work queue does not lower it).
        So a request submitted before an answer is counted here, and nothing is missed by asking
        too early. Our subscription is then waited for until it has seen them all (``next_id``).
        """
        stored = await self._last_seq() - self._seq0
        assert await until(lambda: len(self.ids) >= stored, 10), (stored, self.ids)
        return stored


def generation_id(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]


async def poll_until(stack: Stack, gen_id: str, statuses: set[str], key: str = "sk-alice") -> Reply:
    """The call's status reply once its status is one of ``statuses``."""
    looked: list[Reply] = []

    async def reached() -> bool:
        r = await asyncio.to_thread(call, stack, "GET", f"/v1/requests/{gen_id}", key=key)
        assert r.status == 200, r.body
        looked.append(r)
        return r.body["status"] in statuses

    assert await until(reached, 30, step=0.05), f"{gen_id} never reached {statuses}: {looked[-1].body}"
    return looked[-1]


# -- GET /v1/requests/{id} ---------------------------------------------------------------------------
def test_a_finished_call_can_be_read_back_by_its_tenant_only(stack):
    done = call(stack, "POST", "/v1/images/generations", gen(seed=7, n=2))
    assert done.status == 200, done.body
    assert done.headers["x-request-id"] == done.body["id"]
    assert [d["seed"] for d in done.body["data"]] == [7, 8]
    assert base64.b64decode(done.body["data"][0]["b64_json"]).startswith(PNG_MAGIC)

    again = call(stack, "GET", f"/v1/requests/{done.body['id']}")
    assert again.status == 200, again.body
    assert again.body["status"] == "succeeded" and again.body["completed"] == 2
    assert again.body["data"] == done.body["data"]  # the images as the call answered them
    assert again.body["created"] == done.body["created"] and again.body["model"] == "fast-wf"

    other = call(stack, "GET", f"/v1/requests/{done.body['id']}", key="sk-bob")
    unknown = call(stack, "GET", f"/v1/requests/{uuid.uuid4().hex[:20]}", key="sk-bob")
    assert other.status == unknown.status == 404  # no existence oracle: 404, never 403
    assert other.body["error"]["code"] == unknown.body["error"]["code"] == "not_found"
    assert other.headers["x-should-retry"] == "false"


def test_url_responses_are_read_back_as_urls_and_the_files_are_the_tenants(stack):
    done = call(stack, "POST", "/v1/images/generations", gen(response_format="url"))
    assert done.status == 200, done.body
    url = done.body["data"][0]["url"]
    again = call(stack, "GET", f"/v1/requests/{done.body['id']}")
    assert again.body["data"][0]["url"] == url
    path = url.split(str(stack.gateway_port), 1)[1]
    assert call(stack, "GET", path).raw.startswith(PNG_MAGIC)
    assert call(stack, "GET", path, key="sk-bob").status == 404


async def test_a_running_call_reports_queued_or_running_then_its_result(stack):
    async with Intake(stack) as intake:
        post = asyncio.create_task(
            asyncio.to_thread(call, stack, "POST", "/v1/images/generations", gen("slow-wf"))
        )
        gen_id = generation_id(await intake.next_id())
        early = await asyncio.to_thread(call, stack, "GET", f"/v1/requests/{gen_id}")
        assert early.status == 200 and early.body["status"] in ("queued", "running"), early.body
        assert "data" not in early.body
        done = await post
        late = await poll_until(stack, gen_id, {"succeeded", "failed"})
    assert done.status == 200 and done.body["id"] == gen_id
    assert late.body["status"] == "succeeded" and late.body["data"] == done.body["data"]


def test_a_failed_call_reports_its_error(stack):
    failed = call(stack, "POST", "/v1/images/generations", gen("broken-wf"))
    assert failed.status == 500, failed.body
    gen_id = failed.headers["x-request-id"]
    looked = call(stack, "GET", f"/v1/requests/{gen_id}")
    assert looked.status == 200 and looked.body["status"] == "failed", looked.body
    err = looked.body["error"]
    assert err["status"] == 500 and err["message"] == failed.body["error"]["message"]
    assert "not in simulation profile" in err["message"]


async def test_a_keyed_call_whose_connection_dropped_keeps_running_and_can_be_read_back(stack):
    # With an Idempotency-Key a hang-up does not cancel the call (the client said it would retry);
    # without one it does (tests/integration/test_async_jobs.py).
    key = {"Idempotency-Key": f"keep-{uuid.uuid4().hex}"}
    async with Intake(stack) as intake:

        def hang_up() -> None:
            with pytest.raises((TimeoutError, socket.timeout)):
                call(
                    stack, "POST", "/v1/images/generations", gen("slow-wf", seed=3), headers=key, timeout=0.3
                )

        await asyncio.to_thread(hang_up)
        gen_id = generation_id(await intake.next_id())
        result = await poll_until(stack, gen_id, {"succeeded", "failed"})
    assert result.body["status"] == "succeeded", result.body
    png = base64.b64decode(result.body["data"][0]["b64_json"])  # still there: not consumed by the call
    assert png.startswith(PNG_MAGIC) and result.body["data"][0]["seed"] == 3


# -- idempotency keys --------------------------------------------------------------------------------------
async def test_a_repeated_idempotency_key_returns_the_same_call_and_submits_nothing(stack):
    key = {"Idempotency-Key": f"order-{uuid.uuid4().hex}"}
    async with Intake(stack) as intake:
        first = await asyncio.to_thread(call, stack, "POST", "/v1/images/generations", gen(n=2), headers=key)
        assert first.status == 200, first.body
        submitted = await intake.settle()
        assert submitted == 2
        again = await asyncio.to_thread(call, stack, "POST", "/v1/images/generations", gen(n=2), headers=key)
        assert again.status == 200 and again.body == first.body  # same id, created, seeds, images
        assert await intake.settle() == submitted  # no new GPU work

        changed = await asyncio.to_thread(
            call, stack, "POST", "/v1/images/generations", gen(n=2, prompt="a dog"), headers=key
        )
        assert changed.status == 422 and changed.body["error"]["param"] == "Idempotency-Key"
        assert changed.headers["x-should-retry"] == "false"

        bobs = await asyncio.to_thread(
            call, stack, "POST", "/v1/images/generations", gen(n=2), headers=key, key="sk-bob"
        )
        assert bobs.status == 200 and bobs.body["id"] != first.body["id"]  # keys are per tenant
        assert await intake.settle() == submitted + 2


async def test_concurrent_calls_with_one_idempotency_key_share_one_request(stack):
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    async with Intake(stack) as intake:
        replies = await asyncio.gather(
            *(
                asyncio.to_thread(call, stack, "POST", "/v1/images/generations", gen("slow-wf"), headers=key)
                for _ in range(3)
            )
        )
        assert [r.status for r in replies] == [200, 200, 200], [r.body for r in replies]
        assert len({r.body["id"] for r in replies}) == 1
        assert await intake.settle() == 1


async def test_a_retry_with_the_key_after_a_dropped_connection_gets_the_first_calls_result(stack):
    key = {"Idempotency-Key": f"drop-{uuid.uuid4().hex}"}
    async with Intake(stack) as intake:

        def hang_up() -> None:
            with pytest.raises((TimeoutError, socket.timeout)):
                call(stack, "POST", "/v1/images/generations", gen("slow-wf"), headers=key, timeout=0.3)

        await asyncio.to_thread(hang_up)
        rid = await intake.next_id()
        retried = await asyncio.to_thread(
            call, stack, "POST", "/v1/images/generations", gen("slow-wf"), headers=key
        )
        assert retried.status == 200 and retried.body["id"] == generation_id(rid)
        assert await intake.settle() == 1


def test_a_malformed_idempotency_key_is_refused(stack):
    bad = call(stack, "POST", "/v1/images/generations", gen(), headers={"Idempotency-Key": "x" * 300})
    assert bad.status == 422 and bad.body["error"]["param"] == "Idempotency-Key"


# -- per-tenant admission ---------------------------------------------------------------------------------
async def test_a_tenant_at_its_in_flight_limit_gets_429_while_another_tenant_is_served(stack):
    with ThreadPoolExecutor(TENANT_INFLIGHT) as pool:
        busy = [
            pool.submit(call, stack, "POST", "/v1/images/generations", gen("slow-wf"))
            for _ in range(TENANT_INFLIGHT)
        ]
        gauge = f't2i_gateway_tenant_inflight{{tenant="alice"}} {TENANT_INFLIGHT}'
        assert await until(lambda: gauge in call(stack, "GET", "/metrics", key=None).raw.decode(), 20), (
            "alice's calls never got in flight"
        )

        refused = call(stack, "POST", "/v1/images/generations", gen())
        assert refused.status == 429 and refused.body["error"]["code"] == "tenant_busy", refused.body
        assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-should-retry"] == "true"

        served = call(stack, "POST", "/v1/images/generations", gen(), key="sk-bob")
        assert served.status == 200, served.body
        assert base64.b64decode(served.body["data"][0]["b64_json"]).startswith(PNG_MAGIC)

        # alice was at her limit all along: bob was served while she was saturated
        assert call(stack, "POST", "/v1/images/generations", gen()).status == 429
        assert [f.result(timeout=60).status for f in busy] == [200] * TENANT_INFLIGHT
    assert call(stack, "POST", "/v1/images/generations", gen()).status == 200  # her slots came back


# -- results checked against the request -----------------------------------------------------------------------
async def test_a_forged_result_naming_another_requests_image_is_dropped(stack):
    import nats

    from libs.protocol.messages import ImageRef, RequestResult, encode
    from libs.protocol.subjects import Subjects

    subjects = Subjects(stack.namespace)
    secret = PNG_MAGIC + b"another tenant's picture"
    victim = f"{uuid.uuid4().hex[:20]}-0"
    nc = await nats.connect(stack.nats_url)
    try:
        store = await nc.jetstream().object_store(subjects.images_bucket)
        await store.put(f"{victim}/image.png", secret)
        async with Intake(stack) as intake:
            post = asyncio.create_task(
                asyncio.to_thread(call, stack, "POST", "/v1/images/generations", gen("slow-wf"))
            )
            rid = await intake.next_id()
            stolen = ImageRef(subjects.images_bucket, f"{victim}/image.png", len(secret), 64, 64)
            forged = [
                RequestResult(rid, "succeeded", images={"image": stolen}),  # another request's object
                RequestResult(victim, "succeeded", images={"image": stolen}),  # names another request
                RequestResult(
                    rid, "succeeded", images={"image": ImageRef("other-bucket", f"{rid}/image.png", 1, 1, 1)}
                ),
            ]
            for msg in forged:
                await nc.publish(subjects.result(rid), encode(msg))
            await nc.publish(subjects.result(victim), encode(forged[1]))  # nobody waits for it
            await nc.flush()
            done = await post
    finally:
        await nc.close()
    assert done.status == 200, done.body
    png = base64.b64decode(done.body["data"][0]["b64_json"])
    assert png != secret and png.startswith(PNG_MAGIC)
    log = stack.read_log("gateway")
    assert log.count(f"dropped a result on {subjects.result(rid)}") == 3, log[-3000:]
    looked = call(stack, "GET", f"/v1/requests/{generation_id(rid)}")
    assert base64.b64decode(looked.body["data"][0]["b64_json"]) == png
