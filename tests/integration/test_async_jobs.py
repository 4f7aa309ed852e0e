"""Calls as jobs, against a running platform: ``Prefer: respond-async``, progress events, cancel,
cancel on disconnect, webhooks, recent calls and the executor view.

One stack per module (registry, scheduler, gateway and four simulated executors as processes, over
the real NATS and Redis, in a namespace of its own) with ``fast-wf`` (milliseconds) and ``slow-wf``
(0.75 s per denoising step; calls choose their step count). Nodes of a workflow: text encoding,
latent preparation, one per denoising step, VAE decode.
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from libs.launcher.stack import Stack
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from services.gateway import webhooks
from tests.conftest import cleanup_namespace, free_port
from tests.integration.test_gateway_stack import KEYS, call, write_profile
from tests.support.stacks import sim_stack
from tests.support.waiting import until

SECRET = "whsec-" + uuid.uuid4().hex
ASYNC = {"Prefer": "respond-async"}
EXTRA_NODES = 3  # text, prepare, vae: the nodes besides the denoising steps


@pytest.fixture(scope="module")
def stack(broker_urls, tmp_path_factory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("jobs-stack")
    write_profile(tmp / "profile.json")
    nats_url, redis_url = broker_urls
    s = sim_stack(
        tmp,
        sim_executors=4,
        sim_profile=str(tmp / "profile.json"),
        api_keys=KEYS,
        nats_url=nats_url,
        redis_url=redis_url,
        gateway_env={
            "T2I_GATEWAY_WEBHOOK_SECRET": SECRET,
            "T2I_GATEWAY_WEBHOOK_ATTEMPTS": "3",
            "T2I_GATEWAY_WEBHOOK_BACKOFF_S": "0.2",
        },
    )
    s.start()
    try:
        for fam in ("fast", "slow"):
            spec = json.loads(encode_spec(sim_workflow(f"{fam}-wf", fam, steps=4)))
            status, body = s.http("POST", "/v1/workflows", spec, key="sk-ops")
            assert status == 201, body
        yield s
    finally:
        s.stop()
        asyncio.run(cleanup_namespace(nats_url, redis_url, s.namespace))


def gen(model: str = "fast-wf", **fields) -> dict:
    return {"model": model, "prompt": "a heron", **fields}


def base(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.gateway_port}"


def auth(key: str = "sk-alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def submit_async(stack: Stack, body: dict, key: str = "sk-alice") -> dict:
    r = await asyncio.to_thread(call, stack, "POST", "/v1/images/generations", body, key=key, headers=ASYNC)
    assert r.status == 202, r.body
    assert r.headers["location"] == f"/v1/requests/{r.body['id']}"
    assert r.headers["preference-applied"] == "respond-async"
    return r.body


async def sse_events(
    session: aiohttp.ClientSession, stack: Stack, gen_id: str, last_event_id: str | None = None
) -> AsyncIterator[tuple[str | None, str, dict]]:
    """(id, event, data) of each server-sent event of a call, until the stream closes."""
    headers = auth() | ({"Last-Event-ID": last_event_id} if last_event_id else {})
    async with session.get(f"{base(stack)}/v1/requests/{gen_id}/events", headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        async for raw in resp.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith(":"):
                continue
            if line:
                name, _, value = line.partition(":")
                fields[name] = value.removeprefix(" ")
                continue
            if "data" in fields:
                yield fields.get("id"), fields.get("event", "message"), json.loads(fields["data"])
            fields = {}


async def poll_until(stack: Stack, gen_id: str, statuses: set[str], within_s: float = 30) -> dict:
    """The call's status object once its status is one of ``statuses``."""
    looked: dict = {}

    async def reached() -> bool:
        nonlocal looked
        r = await asyncio.to_thread(call, stack, "GET", f"/v1/requests/{gen_id}")
        assert r.status == 200, r.body
        looked = r.body
        return looked["status"] in statuses

    assert await until(reached, within_s, step=0.05), f"{gen_id} never reached {statuses}: {looked}"
    return looked


# -- respond-async and events ------------------------------------------------------------------------------
async def test_an_async_calls_events_arrive_in_order_with_every_step_then_done(stack):
    steps = 4
    accepted = await submit_async(stack, gen("slow-wf", n=2, num_inference_steps=steps, seed=5))
    assert accepted["status"] in ("queued", "running") and accepted["n"] == 2 and "data" not in accepted
    assert set(accepted["progress"]) == {"nodes_done", "nodes_total", "step", "steps"}

    async with aiohttp.ClientSession() as session:
        got = [e async for e in sse_events(session, stack, accepted["id"])]
        *nodes, (_, last_kind, final) = got
        assert last_kind == "done" and all(kind == "node" for _, kind, _ in nodes), [k for _, k, _ in got]
        total = steps + EXTRA_NODES
        for image in (0, 1):
            mine = [data for _, _, data in nodes if data["image"] == image]
            assert [d["done"] for d in mine] == list(range(1, total + 1))  # in order, none missing
            assert {d["total"] for d in mine} == {total} and {d["steps"] for d in mine} == {steps}
            step_values = [d["step"] for d in mine]
            assert step_values == sorted(step_values) and set(range(1, steps + 1)) <= set(step_values)
            assert [d["fn"] for d in mine].count(mine[-1]["fn"]) >= 1
            assert all(d["request_id"] == f"{accepted['id']}-{image}" for d in mine)
        assert final["id"] == accepted["id"] and final["status"] == "succeeded"
        assert len(final["data"]) == 2 and final["completed"] == 2
        assert final["progress"]["nodes_done"] == final["progress"]["nodes_total"] == 2 * total
        assert final["usage"]["gpu_seconds"] > 0

        # Resumable: from the id of an event, only what came after it.
        cut = len(nodes) // 2
        resumed = [e async for e in sse_events(session, stack, accepted["id"], last_event_id=nodes[cut][0])]
        for image in (0, 1):  # (the two images' events interleave as they come: compare per image)
            after = [d for _, _, d in nodes[cut + 1 :] if d["image"] == image]
            assert [d for _, k, d in resumed if k == "node" and d["image"] == image] == after
        assert resumed[-1][1] == "done"

    looked = await poll_until(stack, accepted["id"], {"succeeded"})
    assert looked["data"] == final["data"]


async def test_the_event_stream_of_a_finished_call_ends_with_done_and_others_get_404(stack):
    accepted = await submit_async(stack, gen())
    await poll_until(stack, accepted["id"], {"succeeded", "failed"})
    async with aiohttp.ClientSession() as session:
        got = [e async for e in sse_events(session, stack, accepted["id"])]
        assert got[-1][1] == "done" and got[-1][2]["status"] == "succeeded"
        async with session.get(
            f"{base(stack)}/v1/requests/{accepted['id']}/events", headers=auth("sk-bob")
        ) as r:
            assert r.status == 404
        headers = auth() | {"Last-Event-ID": "7:1-0"}  # names an image this call does not have
        async with session.get(f"{base(stack)}/v1/requests/{accepted['id']}/events", headers=headers) as r:
            assert r.status == 422 and (await r.json())["error"]["param"] == "Last-Event-ID"


# -- cancelling --------------------------------------------------------------------------------------------
async def test_cancel_in_mid_denoising_ends_the_call_cancelled_and_charges_only_what_ran(stack):
    steps = 12
    accepted = await submit_async(stack, gen("slow-wf", num_inference_steps=steps))
    gen_id = accepted["id"]
    async with aiohttp.ClientSession() as session:
        events = sse_events(session, stack, gen_id)
        async for _, kind, data in events:  # wait until denoising is under way
            assert kind == "node", data
            if data["step"] >= 1:
                break
        async with session.post(f"{base(stack)}/v1/requests/{gen_id}/cancel", headers=auth("sk-bob")) as r:
            assert r.status == 404  # another tenant's call does not exist for bob
        async with session.post(f"{base(stack)}/v1/requests/{gen_id}/cancel", headers=auth()) as r:
            assert r.status == 200, await r.text()
            answered = await r.json()
        assert answered["id"] == gen_id and answered["status"] in ("running", "cancelled")
        rest = [e async for e in events]
    assert rest[-1][1] == "done" and rest[-1][2]["status"] == "cancelled", rest[-1]
    final = await poll_until(stack, gen_id, {"cancelled"})
    assert final["status"] == "cancelled" and final["error"]["code"] == "cancelled"
    assert final["progress"]["nodes_done"] < steps + EXTRA_NODES  # nothing ran to the end
    charged = final["usage"]["gpu_seconds"]
    assert 0 < charged < steps * 0.75, final["usage"]

    again = await asyncio.to_thread(call, stack, "POST", f"/v1/requests/{gen_id}/cancel")
    assert again.status == 200 and again.body["status"] == "cancelled"  # ended: its final state


async def test_a_waiting_sync_call_cancelled_through_the_route_answers_409_cancelled(stack):
    body = gen("slow-wf", num_inference_steps=12, user=uuid.uuid4().hex)
    waiting = asyncio.create_task(asyncio.to_thread(call, stack, "POST", "/v1/images/generations", body))
    listed: dict = {}

    async def recorded_running() -> bool:  # the call, once the gateway has recorded it running
        nonlocal listed
        listed = (await asyncio.to_thread(call, stack, "GET", "/v1/requests?limit=1")).body
        return bool(listed["data"]) and listed["data"][0]["status"] == "running"

    assert await until(recorded_running, 20, step=0.05), f"the call never showed as running: {listed}"
    gen_id = listed["data"][0]["id"]
    cancelled = await asyncio.to_thread(call, stack, "POST", f"/v1/requests/{gen_id}/cancel")
    assert cancelled.status == 200, cancelled.body
    answered = await waiting
    assert answered.status == 409 and answered.body["error"]["code"] == "cancelled", answered.body
    assert answered.headers["x-request-id"] == gen_id


async def test_a_sync_call_whose_client_disconnects_is_cancelled(stack):
    def hang_up() -> None:
        with pytest.raises((TimeoutError, socket.timeout)):
            call(stack, "POST", "/v1/images/generations", gen("slow-wf", num_inference_steps=12), timeout=1.0)

    await asyncio.to_thread(hang_up)
    listed = await asyncio.to_thread(call, stack, "GET", "/v1/requests?limit=1")
    assert listed.status == 200 and listed.body["object"] == "list", listed.body
    gen_id = listed.body["data"][0]["id"]
    final = await poll_until(stack, gen_id, {"cancelled", "succeeded", "failed"})
    assert final["status"] == "cancelled", final
    assert final["progress"]["nodes_done"] < 12 + EXTRA_NODES


# -- webhooks ----------------------------------------------------------------------------------------------
async def test_a_webhook_is_delivered_signed_and_retried_once_after_a_failure(stack):
    attempts: list[tuple[dict[str, str], bytes]] = []
    delivered = asyncio.Event()

    async def receive(request: web.Request) -> web.Response:
        attempts.append((dict(request.headers), await request.read()))
        if len(attempts) == 1:
            return web.Response(status=503, text="not now")
        delivered.set()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        accepted = await submit_async(stack, gen(webhook=f"http://127.0.0.1:{port}/hook?src=t2i", seed=9))
        await asyncio.wait_for(delivered.wait(), 30)
        # No third attempt: the gateway logs "delivered (attempt N)" once it has read the answer of
        # the attempt that succeeded, and its delivery returns right there (Webhooks.deliver); a
        # call has one delivery (jobs.follow). Once this line is logged no attempt can follow, and
        # "attempt 2" says the 204 answered the second one (none was made in between).
        line = f"webhook of {accepted['id']} delivered (attempt 2)"
        assert await until(lambda: line in stack.read_log("gateway"), 10), stack.tail("gateway")
    finally:
        await runner.cleanup()
    assert len(attempts) == 2
    for headers, body in attempts:
        assert headers["X-T2I-Webhook-Id"] == accepted["id"]
        assert webhooks.verify(SECRET, headers["X-T2I-Signature"], body)
        assert not webhooks.verify("another-secret", headers["X-T2I-Signature"], body)
        assert not webhooks.verify(SECRET, headers["X-T2I-Signature"], body + b" ")
    sent = json.loads(attempts[1][1])
    assert sent["id"] == accepted["id"] and sent["status"] == "succeeded"
    assert sent["data"][0]["seed"] == 9 and sent["data"][0]["b64_json"]
    looked = await poll_until(stack, accepted["id"], {"succeeded"})
    assert looked["data"] == sent["data"]


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/x",
        "http:///nohost",
        "not a url",
        "http://user:pw@example.com/",
        5,
        "",
        "https://x/" + "a" * 2048,
    ],
)
def test_a_bad_webhook_url_is_refused_with_422(stack, url):
    r = call(stack, "POST", "/v1/images/generations", gen(webhook=url))
    assert r.status == 422 and r.body["error"]["param"] == "webhook", r.body


# -- lists -------------------------------------------------------------------------------------------------
async def test_recent_calls_are_listed_newest_first_per_tenant(stack):
    first = await submit_async(stack, gen(), key="sk-bob")
    second = await submit_async(stack, gen(), key="sk-bob")
    mine = await asyncio.to_thread(call, stack, "GET", "/v1/requests?limit=2", key="sk-bob")
    assert mine.status == 200 and [d["id"] for d in mine.body["data"]] == [second["id"], first["id"]]
    assert all("data" not in d and "status" in d for d in mine.body["data"])
    alices = await asyncio.to_thread(call, stack, "GET", "/v1/requests?limit=100")
    assert first["id"] not in {d["id"] for d in alices.body["data"]}
    nosy = await asyncio.to_thread(call, stack, "GET", "/v1/requests?tenant=bob")
    assert nosy.status == 403
    ops = await asyncio.to_thread(call, stack, "GET", "/v1/requests?tenant=*&limit=100", key="sk-ops")
    listed = {d["id"]: d.get("tenant") for d in ops.body["data"]}
    assert listed[first["id"]] == "bob"
    for bad in ("0", "101", "x"):
        r = await asyncio.to_thread(call, stack, "GET", f"/v1/requests?limit={bad}")
        assert r.status == 422 and r.body["error"]["param"] == "limit"


def test_the_executor_view_is_for_admins(stack):
    assert call(stack, "GET", "/v1/admin/executors").status == 403
    r = call(stack, "GET", "/v1/admin/executors", key="sk-ops")
    assert r.status == 200 and r.body["object"] == "list", r.body
    assert len(r.body["data"]) == 4, r.body  # the four simulated executors
    assert all({"id", "fns", "resident", "running"} <= set(e) for e in r.body["data"])


async def test_a_repeated_async_call_with_its_idempotency_key_answers_the_first_calls_status(stack):
    headers = ASYNC | {"Idempotency-Key": f"job-{uuid.uuid4().hex}"}
    replies = [
        await asyncio.to_thread(call, stack, "POST", "/v1/images/generations", gen(seed=4), headers=headers)
        for _ in range(2)
    ]
    assert [r.status for r in replies] == [202, 202], [r.body for r in replies]
    assert replies[0].body["id"] == replies[1].body["id"]
    assert (await poll_until(stack, replies[0].body["id"], {"succeeded"}))["data"][0]["seed"] == 4


async def test_a_call_cancelled_as_soon_as_it_is_accepted_ends_cancelled(stack):
    accepted = await submit_async(stack, gen("slow-wf", n=2, num_inference_steps=8))
    r = await asyncio.to_thread(call, stack, "POST", f"/v1/requests/{accepted['id']}/cancel")
    assert r.status == 200, r.body
    final = await poll_until(stack, accepted["id"], {"cancelled", "succeeded", "failed"})
    assert final["status"] == "cancelled" and final["completed"] == 2, final
