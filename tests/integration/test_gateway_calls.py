"""A generation call driven through ``services.gateway.calls.Call`` itself, over real NATS and Redis.

No scheduler runs: each test writes its image requests' states into Redis as the scheduler does
(``{ns}:req:{request_id}``: ``status``, ``tenant``, ``result``), then checks what the call makes of
them (its status), what a cancel flags there and tells the scheduler on the bus, and what a repeat
with the call's ``Idempotency-Key`` gets.
"""

from __future__ import annotations

import time
import uuid

import pytest
from aiohttp import web

from libs.common.nats_conn import connect
from libs.models.flux_workflows import tiny_flux
from libs.protocol.messages import RequestResult, cancel_decoder, encode
from libs.protocol.subjects import Subjects
from services.gateway.app import make_app
from services.gateway.auth import ApiKeys
from services.gateway.calls import Call, Origin
from services.gateway.config import GatewayConfig
from services.gateway.context import ADMISSION, BRIDGE, RECORDS
from services.gateway.errors import ApiError
from services.gateway.generation import parse_generation
from services.gateway.records import GenerationRecord
from tests.support.waiting import elapse, until

ORIGIN = Origin("http", "gateway.test")


@pytest.fixture
async def app(common):
    """The gateway's app with its connections open (no HTTP server: the tests call ``Call``)."""
    app = make_app(GatewayConfig(max_n=4), common, ApiKeys({}))
    runner = web.AppRunner(app)
    await runner.setup()
    yield app
    await runner.cleanup()


async def recorded(app: web.Application, n: int, tenant: str = "alice") -> Call:
    rec = GenerationRecord(
        uuid.uuid4().hex[:20], tenant, "tiny-flux", int(time.time()), n, "b64_json", [None] * n, 30.0
    )
    await app[RECORDS].save(rec)
    call = await Call.load(app, rec.id)
    assert call is not None and call.rec == rec
    return call


async def image_is(
    app: web.Application, request_id: str, status: str, result: RequestResult | None = None
) -> None:
    """Write an image request's state as the scheduler keeps it (the tenant is alice's)."""
    bridge = app[BRIDGE]
    fields: dict[str, object] = {"status": status, "tenant": "alice"}
    if result is not None:
        fields["result"] = encode(result)
    await bridge.redis.hset(bridge.keys.request(request_id), mapping=fields)


def cancelled(request_id: str, gpu_s: float = 0.0) -> RequestResult:
    return RequestResult(
        request_id, "cancelled", error="cancelled by the tenant", error_code="cancelled", gpu_s=gpu_s
    )


async def test_a_call_with_a_cancelled_image_runs_until_its_other_image_ended_then_is_cancelled(app):
    call = await recorded(app, 2)
    finished, stopped = call.rec.request_ids
    await image_is(app, stopped, "cancelled", cancelled(stopped, gpu_s=0.5))
    await image_is(app, finished, "running")
    status = await call.status(ORIGIN)
    assert status["status"] == "running" and status["completed"] == 1
    assert "error" not in status and "data" not in status

    await image_is(app, finished, "succeeded", RequestResult(finished, "succeeded", gpu_s=1.25))
    status = await call.status(ORIGIN)
    assert status["id"] == call.id and status["n"] == 2
    assert status["status"] == "cancelled" and status["completed"] == 2
    assert status["error"]["code"] == "cancelled" and status["error"]["status"] == 409
    assert stopped in status["error"]["message"] and "cancelled by the tenant" in status["error"]["message"]
    assert status["usage"]["gpu_seconds_per_image"] == [1.25, 0.5]
    assert status["usage"]["gpu_seconds"] == 1.75
    assert "data" not in status


async def test_a_call_whose_images_failed_and_were_cancelled_reports_cancelled(app):
    """A cancelled image decides a call's status over a failed one (``results.call_status``)."""
    call = await recorded(app, 2)
    failed, stopped = call.rec.request_ids
    await image_is(
        app, failed, "failed", RequestResult(failed, "failed", error="it broke", error_code="internal")
    )
    await image_is(app, stopped, "cancelled", cancelled(stopped))
    status = await call.status(ORIGIN)
    assert status["status"] == "cancelled" and status["error"]["status"] == 409


async def test_cancel_flags_and_announces_only_the_images_that_have_not_ended(app, common):
    call = await recorded(app, 3)
    ended, queued, running = call.rec.request_ids
    await image_is(app, ended, "succeeded", RequestResult(ended, "succeeded"))
    await image_is(app, queued, "queued")
    await image_is(app, running, "running")
    nc = await connect(common.nats_url, "test-scheduler")
    told = []
    try:

        async def heard(msg) -> None:
            told.append(cancel_decoder.decode(msg.data))

        await nc.subscribe(Subjects(common.namespace).cancels, cb=heard)
        await nc.flush()
        await call.cancel("cancelled by the tenant", wait_s=0)
        assert await until(lambda: len(told) >= 2, within_s=5), "the scheduler was told of two cancels"
        await elapse(0.3, because="a cancel of the ended image would have been told by then")
    finally:
        await nc.close()

    assert sorted(m.request_id for m in told) == sorted([queued, running])
    assert {(m.tenant, m.reason) for m in told} == {("alice", "cancelled by the tenant")}
    bridge = app[BRIDGE]
    for rid in (queued, running):
        flags = await bridge.redis.hmget(bridge.keys.request(rid), "cancel", "cancel_reason")
        assert flags[0] is not None and flags[1] == b"cancelled by the tenant", rid
    assert await bridge.redis.hget(bridge.keys.request(ended), "cancel") is None
    flagged = await bridge.redis.zrange(bridge.keys.cancels, 0, -1)
    assert sorted(f.decode() for f in flagged) == sorted([queued, running])


async def test_cancelling_a_call_whose_images_all_ended_changes_nothing(app):
    call = await recorded(app, 2)
    first, second = call.rec.request_ids
    await image_is(app, first, "succeeded", RequestResult(first, "succeeded"))
    await image_is(app, second, "cancelled", cancelled(second))
    await call.cancel("cancelled by the tenant")
    bridge = app[BRIDGE]
    assert await bridge.redis.zrange(bridge.keys.cancels, 0, -1) == []
    assert (await call.status(ORIGIN))["status"] == "cancelled"


async def test_the_answer_of_a_call_is_the_error_of_its_first_image_without_one(app):
    call = await recorded(app, 2)
    timed_out, failed = call.rec.request_ids
    results = [None, RequestResult(failed, "failed", error="it broke", error_code="internal")]
    with pytest.raises(ApiError) as raised:
        await call.answer(ORIGIN, results, stale=False)
    assert raised.value.status == 504 and raised.value.code == "timeout"
    assert timed_out in raised.value.message
    assert raised.value.headers["x-request-id"] == call.id


async def test_a_repeat_with_the_calls_idempotency_key_gets_that_call_and_admits_nothing(app):
    spec = tiny_flux()
    body = {"model": spec.name, "prompt": "a cat", "n": 2}

    def create(tenant: str, given: dict, key: str | None):
        return Call.create(app, tenant, spec, parse_generation(dict(given), spec, 4), given, key)

    first = await create("alice", body, "key-1")
    assert not first.replayed
    assert app[ADMISSION].inflight == 2  # the call holds its slots until submit hands them on
    first.submit(ORIGIN)
    assert app[ADMISSION].inflight == 2

    again = await create("alice", dict(body), "key-1")
    assert again.replayed and again.id == first.id and again.rec == first.rec
    assert app[ADMISSION].inflight == 2

    with pytest.raises(ApiError) as raised:
        await create("alice", {**body, "prompt": "a dog"}, "key-1")
    assert raised.value.status == 422 and raised.value.code == "idempotency_mismatch"
    assert raised.value.param == "Idempotency-Key"
    assert app[ADMISSION].inflight == 2

    other = await create("bob", body, "key-1")  # a key is the tenant's own
    assert not other.replayed and other.id != first.id
    other.submit(ORIGIN)
    assert app[ADMISSION].inflight == 4
    plain = await create("alice", body, None)  # without a key, every call is new
    assert not plain.replayed and plain.id not in (first.id, other.id)
    plain.submit(ORIGIN)
    assert app[ADMISSION].inflight == 6
