"""Progress events and cancel of image requests, over simulated executors and real NATS and Redis.

One stack of two simulated executors (``sim_stack``, paper-h800 timings at real speed: a Flux1-dev
denoising step takes ~0.24 s) serves the module; the scheduler admits one request at a time
(``max_active`` 1), so a second request waits in its admission backlog while the first runs. Each
test drives the scheduler as the gateway does, through ``services.gateway.bridge.Bridge``: it
submits ``ImageRequest``s to the intake, reads the request's progress stream
(``Bridge.events``), and cancels (``Bridge.cancel``). Every test uses a tenant of its own, so the
tenant's vTime in Redis is what its requests were charged.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.msg import Msg

from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis
from libs.launcher.stack import Stack
from libs.protocol.keys import Keys
from libs.protocol.messages import (
    CancelRequest,
    ImageRequest,
    RequestResult,
    encode,
    sched_decoder,
)
from libs.protocol.subjects import Subjects
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from services.gateway.bridge import Bridge
from tests.support.stacks import sim_stack, started
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(180)

WORKFLOW = "sim-flux"
STEPS = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory, broker_urls) -> Iterator[Stack]:
    s = sim_stack(
        tmp_path_factory.mktemp("progress"),
        scheduler_env={"T2I_SCHEDULER_MAX_ACTIVE": "1", "T2I_SCHEDULER_VIEW_S": "0.2"},
    )
    with started(s):
        spec = json.loads(encode_spec(sim_workflow(WORKFLOW, "flux1-dev", steps=STEPS)))
        status, body = s.http("POST", "/v1/workflows", spec)
        assert status == 201, body
        yield s


@pytest.fixture
async def bridge(stack: Stack) -> AsyncIterator[Bridge]:
    nc = await connect(stack.nats_url, "test-progress")
    redis = connect_redis(stack.redis_url)
    b = Bridge(nc, redis, Subjects(stack.namespace), Keys(stack.namespace))
    await b.start()
    try:
        yield b
    finally:
        await b.stop()
        await nc.close()
        await redis.aclose()


def image_request(tenant: str, steps: int = STEPS) -> ImageRequest:
    return ImageRequest(
        request_id=uuid.uuid4().hex[:20],
        tenant=tenant,
        workflow=WORKFLOW,
        version=0,
        params={"prompt": "a lighthouse", "seed": 1, "num_inference_steps": steps},
        submitted_at=time.time(),
        timeout_s=120.0,
    )


async def submit(bridge: Bridge, req: ImageRequest) -> asyncio.Future[RequestResult]:
    fut = bridge.expect(req.request_id)
    await bridge.submit(req)
    return fut


async def read_events(bridge: Bridge, rid: str, after: str = "0-0") -> list[dict]:
    """The request's events from ``after`` on, up to its ``end`` event."""
    out: list[dict] = []
    while True:
        batch = await bridge.events(rid, after, block_ms=10_000)
        assert batch, f"no end event for {rid}; got {out}"
        for eid, ev in batch:
            out.append(ev)
            after = eid
            if ev["type"] == "end":
                return out


async def stored(bridge: Bridge, rid: str) -> RequestResult:
    """The result once it is stored in Redis (after the request's charges were written)."""
    found: list[RequestResult] = []

    async def is_stored() -> bool:
        res = await bridge.stored_result(rid)
        found.extend([res] if res is not None else [])
        return res is not None

    assert await until(is_stored, 10, step=0.05), f"no stored result for {rid}"
    return found[-1]


async def vtime(bridge: Bridge, tenant: str) -> tuple[float, float]:
    v, s = await asyncio.gather(
        bridge.redis.hget(bridge.keys.vtime, tenant), bridge.redis.hget(bridge.keys.service, tenant)
    )
    return float(v or 0.0), float(s or 0.0)


def node_s(ev: dict) -> float:
    t = ev["timing"]
    return t["load_s"] + t["fetch_s"] + t["exec_s"] + t["store_s"]


async def test_progress_events_arrive_in_order_one_per_node_with_every_step(bridge: Bridge):
    req = image_request("tenant-progress")
    fut = await submit(bridge, req)
    events = await read_events(bridge, req.request_id)
    result = await asyncio.wait_for(fut, 60)
    assert result.status == "succeeded", result

    nodes, end = events[:-1], events[-1]
    total = STEPS + 3  # text, prepare, the steps, vae
    assert [e["type"] for e in nodes] == ["node"] * total
    assert [e["done"] for e in nodes] == list(range(1, total + 1))  # in order, one per node
    assert len({e["node_id"] for e in nodes}) == total
    assert all(e["total"] == total and e["steps"] == STEPS for e in nodes)
    assert all(e["request_id"] == req.request_id and e["executor"] for e in nodes)
    steps = [e["step"] for e in nodes]
    assert steps == sorted(steps) and steps[-1] == STEPS
    # Every step shows: one event per denoising node, each counting one more step.
    dit = [e for e in nodes if e["node_id"].startswith("dit@")]
    assert [e["step"] for e in dit] == list(range(1, STEPS + 1))
    assert [e["node_id"] for e in dit] == [f"dit@{i}" for i in range(STEPS)]
    assert len({e["fn"] for e in dit}) == 1 and all(e["model"] == "flux1-dev/dit" for e in dit)
    gpu = [e["gpu_s"] for e in nodes]
    assert gpu == sorted(gpu) and all(e["t"] > 0 for e in events)
    assert nodes[-1]["gpu_s"] == pytest.approx(sum(node_s(e) for e in nodes), abs=1e-5)

    assert end == {
        "type": "end",
        "request_id": req.request_id,
        "status": "succeeded",
        "gpu_s": pytest.approx(result.gpu_s, abs=1e-5),
        "done": total,
        "total": total,
        "t": end["t"],
    }
    assert result.nodes_run == total and result.gpu_s == pytest.approx(nodes[-1]["gpu_s"], abs=1e-5)
    state = await bridge.redis.hgetall(bridge.keys.request(req.request_id))
    assert int(state[b"nodes_done"]) == int(state[b"nodes_total"]) == total
    assert int(state[b"step"]) == int(state[b"steps"]) == STEPS
    await stored(bridge, req.request_id)
    v, s = await vtime(bridge, req.tenant)
    assert s == pytest.approx(result.gpu_s, abs=1e-5)


async def test_cancel_mid_denoising_frees_executors_and_charges_only_the_nodes_that_ran(
    bridge: Bridge, stack: Stack
):
    heartbeats: list[tuple[str, list[str]]] = []  # (executor, the nodes it runs), as received
    ended_nodes: list[str] = []  # the nodes of this request an executor reported done or failed

    async def on_event(msg: Msg) -> None:
        ev = sched_decoder.decode(msg.data)
        if type(ev).__name__ == "ExecutorHeartbeat":
            heartbeats.append((ev.executor, list(ev.running)))
        elif type(ev).__name__ in ("NodeComplete", "NodeFailed") and ev.request_id == rid:
            ended_nodes.append(ev.node_id)

    req = image_request("tenant-cancel", steps=28)
    rid = req.request_id
    sub = await bridge.nc.subscribe(bridge.subjects.sched_events, cb=on_event)
    fut = await submit(bridge, req)
    seen: list[dict] = []
    after = "0-0"
    while not seen or seen[-1]["step"] < 3:  # mid-denoising: three steps done, 25 to go
        batch = await bridge.events(rid, after, block_ms=10_000)
        assert batch, f"no progress: {seen}"
        seen += [ev for _, ev in batch]
        after = batch[-1][0]
        assert seen[-1]["type"] == "node", seen[-1]

    assert await bridge.cancel(rid, "someone-else") is False  # another tenant's: refused
    assert await bridge.cancel(rid, req.tenant) is True
    result = await asyncio.wait_for(fut, 10)
    assert result.status == "cancelled" and result.error_code == "cancelled", result
    assert result.images == {}
    ended = len(heartbeats)  # the heartbeats from here on were received after the request ended
    executors = set(stack.executor_ids()["sim-executors"])

    def runs_it(running: list[str]) -> bool:
        return any(n.startswith(rid) for n in running)

    async def view() -> dict[str, dict]:
        raw = await bridge.redis.hgetall(bridge.keys.executors_view)
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def freed() -> bool:
        # Every executor has said, in a heartbeat received after the end, that it runs no node of
        # it, and the operator view (the scheduler's own record) shows every executor idle.
        said = {ex for ex, running in heartbeats[ended:] if not runs_it(running)}
        v = await view()
        return said == executors and set(v) == executors and all(x["running"] == 0 for x in v.values())

    # No executor runs a node of it any more (the heartbeats say so), and the view shows it ...
    assert await until(freed, 15), (heartbeats[ended:], await view())
    await sub.unsubscribe()
    assert all(v["kind"] == "sim" and v["fns"] for v in (await view()).values())
    assert any(v["resident"] for v in (await view()).values())

    # The events: one per node that ran, and the end; nothing dispatched after the cancel ran.
    events = seen + await read_events(bridge, rid, after=after)
    nodes, end = events[:-1], events[-1]
    assert end["type"] == "end" and end["status"] == "cancelled"
    assert len(nodes) == end["done"] == result.nodes_run < end["total"] == result.nodes == 28 + 3
    assert nodes[-1]["step"] < 28
    # ... and none ran after the cancel: an executor reports the end of every node it ran (done or
    # failed) on the stream we subscribed to before submitting. Besides the nodes counted above,
    # one may have ended: the one running when the request was cancelled (its CancelNode stops it,
    # or it completed as the cancel came). The scheduler had every node it dispatched answered
    # once its view shows every executor idle, and it dispatches none of a request it has ended
    # (it let go of the request in the step that ended it): so a node of it started after the
    # cancel would have ended by now and be a second one here.
    uncounted = set(ended_nodes) - {e["node_id"] for e in nodes}
    assert len(uncounted) <= 1, (uncounted, ended_nodes)
    ran = sum(node_s(e) for e in nodes)
    assert result.gpu_s == pytest.approx(ran, abs=1e-5) == pytest.approx(end["gpu_s"], abs=1e-5)

    # The tenant was charged the nodes that ran, no more (the running one's estimate was refunded).
    stored_result = await stored(bridge, rid)
    assert stored_result.status == "cancelled"
    v, s = await vtime(bridge, req.tenant)
    assert v == pytest.approx(ran, abs=1e-5) and s == pytest.approx(ran, abs=1e-5)
    state = await bridge.redis.hgetall(bridge.keys.request(rid))
    assert state[b"status"] == b"cancelled" and b"cancel" in state

    # Cancelling it again does nothing.
    assert await bridge.cancel(rid, req.tenant) is False


async def test_cancel_of_a_queued_request_and_of_a_finished_one(bridge: Bridge):
    tenant = "tenant-queue"
    # A finished request: the bridge refuses, and a cancel sent anyway changes nothing.
    done = image_request(tenant, steps=2)
    fut = await submit(bridge, done)
    assert (await asyncio.wait_for(fut, 60)).status == "succeeded"
    before = await stored(bridge, done.request_id)
    events = await bridge.redis.xlen(bridge.keys.events(done.request_id))
    assert await bridge.cancel(done.request_id, tenant) is False
    await bridge.nc.publish(bridge.subjects.cancels, encode(CancelRequest(done.request_id, tenant)))

    # One request runs (the scheduler admits one at a time); the next waits queued behind it.
    running = image_request(tenant, steps=28)
    queued = image_request(tenant, steps=2)
    running_fut = await submit(bridge, running)
    assert await bridge.events(running.request_id, block_ms=10_000)  # it runs: a node finished
    queued_fut = await submit(bridge, queued)

    # Taken in (its attempt counted), and waiting for admission.
    async def taken_in() -> bool:
        return bool(await bridge.redis.hget(bridge.keys.request(queued.request_id), "attempt"))

    assert await until(taken_in, 10, step=0.05), "the queued request was never taken in"
    assert await bridge.cancel(queued.request_id, tenant) is True
    result = await asyncio.wait_for(queued_fut, 10)
    assert result.status == "cancelled" and result.nodes_run == 0 and result.gpu_s == 0.0
    assert not running_fut.done()  # the running one goes on
    assert [e["type"] for e in await read_events(bridge, queued.request_id)] == ["end"]

    # The finished one is as it was: result, charge and events.
    assert await bridge.stored_result(done.request_id) == before
    assert await bridge.redis.xlen(bridge.keys.events(done.request_id)) == events
    assert await bridge.cancel(running.request_id, tenant) is True
    assert (await asyncio.wait_for(running_fut, 10)).status == "cancelled"


async def test_a_request_flagged_before_it_is_taken_in_is_answered_cancelled(bridge: Bridge):
    """What a new leader does with a request cancelled while the old one held it (or before any
    scheduler took it in): the take-in reads the flag and answers ``cancelled``; nothing runs."""
    req = image_request("tenant-flagged")
    await bridge.redis.hset(bridge.keys.request(req.request_id), mapping={"cancel": time.time()})
    fut = await submit(bridge, req)
    result = await asyncio.wait_for(fut, 30)
    assert result.status == "cancelled" and result.nodes_run == 0 and result.gpu_s == 0.0
    assert [e["type"] for e in await read_events(bridge, req.request_id)] == ["end"]
    assert await vtime(bridge, req.tenant) == (0.0, 0.0)


@pytest.fixture
def secure_stack(tmp_path, broker_urls) -> Iterator[Stack]:
    with started(sim_stack(tmp_path, secure=True)) as s:
        yield s


async def test_with_the_roles_credentials_the_gateway_cancels_and_reads_events(secure_stack: Stack):
    """A secured stack (per-role NATS users and Redis ACL users): the gateway's user may flag,
    announce and read what ``Bridge.cancel`` and ``Bridge.events`` need, and the scheduler's user
    may write the streams, the executors view and poll the cancels."""
    s = secure_stack
    assert s.credentials is not None
    spec = json.loads(encode_spec(sim_workflow(WORKFLOW, "flux1-dev", steps=28)))
    status, body = s.http("POST", "/v1/workflows", spec)
    assert status == 201, body
    nc = await connect(s.credentials.nats_url(s.bus_url, "gateway"), "test-gateway")
    redis = connect_redis(s.credentials.redis_url(s.redis_url, "gateway"))
    gw = Bridge(nc, redis, Subjects(s.namespace), Keys(s.namespace))
    await gw.start()
    try:
        req = image_request("tenant-secure", steps=28)
        fut = await submit(gw, req)
        first = await gw.events(req.request_id, block_ms=15_000)
        assert first and first[0][1]["type"] == "node"
        assert await gw.cancel(req.request_id, req.tenant) is True
        result = await asyncio.wait_for(fut, 10)
        assert result.status == "cancelled" and 0 < result.nodes_run < result.nodes
        events = await read_events(gw, req.request_id)
        assert events[-1]["status"] == "cancelled" and len(events) == result.nodes_run + 1
        view: dict = {}

        async def both_in_view() -> bool:  # refreshed every second
            nonlocal view
            view = await gw.redis.hgetall(gw.keys.executors_view)
            return len(view) == 2

        assert await until(both_in_view, 10, step=0.1), view
        log = s.read_log("scheduler")
        assert "NOPERM" not in log and "NoPermission" not in log and "stepping down" not in log, log[-3000:]
    finally:
        await gw.stop()
        await nc.close()
        await redis.aclose()
