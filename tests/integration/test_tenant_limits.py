"""Per-tenant limits across the platform (``services/gateway/limits.py``, the scheduler's
``max_tenant_backlog``): the real gateway app, scheduler, registry and simulated executors in this
process, over real NATS and Redis.

- A tenant with ``T2I_GATEWAY_TENANT_QUEUED`` requests queued (in the scheduler's core, unstarted,
  and in its backlog) gets 429 ``tenant_queue_full`` with ``Retry-After``; another tenant's call is
  still taken in; once the work drains the first tenant is admitted again.
- The scheduler answers ``rate_limited`` to a request of a tenant whose backlog is at
  ``max_tenant_backlog``, and the gateway answers that call 429 with ``Retry-After`` and gives its
  ``Idempotency-Key`` back, so a retry with the key is a new call.
- A tenant past its GPU-second quota gets 429 ``quota_exceeded`` until the window ends (a 4 s
  window here); an admin's override lifts another tenant's quota.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import make_app
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from tests.integration.test_scheduler_faults import WORKFLOW, World, profile
from tests.support.waiting import elapse, until

pytestmark = pytest.mark.timeout(120)

GEN = "/v1/images/generations"
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
ADMIN = {"Authorization": "Bearer sk-ops"}
BODY = {"model": WORKFLOW, "prompt": "x"}


@pytest.fixture
async def world(common):
    async with World(common) as w:
        yield w


@contextlib.asynccontextmanager
async def gateway(world: World, cfg: GatewayConfig):
    app = make_app(cfg, world.common, ApiKeys.load("sk-alice=alice,sk-bob=bob,sk-ops=ops:admin"))
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def error_of(resp, status: int, code: str) -> str:
    """The error's message, after checking its status, code and retry headers."""
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert err["code"] == code and err["type"] == "rate_limit_error", err
    assert int(resp.headers["Retry-After"]) >= 1 and resp.headers["x-should-retry"] == "true"
    return err["message"]


async def ok(call) -> dict:
    resp = await call
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def queued_counts(world: World, tenant: str) -> int:
    """What the gateway reads: the scheduler's view (unstarted in the core) plus its backlog."""
    view = await world.redis.hget(world.keys.tenants, tenant)
    backlog = await world.redis.hget(world.keys.backlog, tenant)
    return (json.loads(view)["queued"] if view else 0) + int(backlog or 0)


async def test_a_tenant_over_its_queued_limit_gets_429_while_another_tenant_is_admitted(world):
    await world.start_registry()
    sched = await world.start_scheduler(max_active=1, view_s=0.1)
    async with gateway(world, GatewayConfig(tenant_queued=3, request_timeout_s=60)) as client:
        # No executor yet: one request waits unstarted in the core, two in the scheduler's backlog.
        calls = [asyncio.create_task(client.post(GEN, json=BODY, headers=ALICE)) for _ in range(3)]
        assert await until(lambda: sched.core.active == 1 and sched.machine.backlog.count("alice") == 2, 10.0)

        async def all_counted() -> bool:  # the scheduler's view and backlog counts show all three
            return await queued_counts(world, "alice") == 3

        assert await until(all_counted, 5.0)

        async def gateway_counts_all() -> bool:
            # The admin view reads the counts afresh (it drops the tenant's cached ones) and leaves
            # what it read in the cache that the next call's check uses: no stale count remains.
            limits = await (await client.get("/v1/admin/tenants/alice/limits", headers=ADMIN)).json()
            return limits["queued"]["used"] == 3

        assert await until(gateway_counts_all, 5.0), "the gateway never counted alice's three queued"
        message = await error_of(await client.post(GEN, json=BODY, headers=ALICE), 429, "tenant_queue_full")
        assert "3 queued, limit 3" in message
        four = {**BODY, "n": 4}  # could never fit the limit: 422, not worth retrying
        resp = await client.post(GEN, json=four, headers=ALICE)
        assert resp.status == 422 and (await resp.json())["error"]["param"] == "n"

        bob = asyncio.create_task(client.post(GEN, json=BODY, headers=BOB))  # another tenant: taken in
        assert await until(lambda: sched.machine.backlog.count("bob") == 1, 5.0)
        assert not bob.done()

        await world.add_executor("sim-0", profile())
        for call in [*calls, bob]:
            assert len((await ok(call))["data"]) == 1

        async def admitted_again() -> bool:
            resp = await client.post(GEN, json=BODY, headers=ALICE)
            return resp.status == 200

        assert await until(admitted_again, 10.0, step=0.2), "alice was not admitted once her queue drained"
        assert await world.redis.hget(world.keys.backlog, "alice") in (None, b"0")


async def test_the_schedulers_per_tenant_backlog_cap_answers_rate_limited_and_the_gateway_429(world):
    await world.start_registry()
    sched = await world.start_scheduler(max_active=1, max_tenant_backlog=1)
    async with gateway(world, GatewayConfig(request_timeout_s=60)) as client:
        first = asyncio.create_task(client.post(GEN, json=BODY, headers=ALICE))
        assert await until(lambda: sched.core.active == 1, 10.0)
        second = asyncio.create_task(client.post(GEN, json=BODY, headers=ALICE))
        assert await until(lambda: sched.machine.backlog.count("alice") == 1, 10.0)

        keyed = {**ALICE, "Idempotency-Key": "retry-me"}
        resp = await client.post(GEN, json=BODY, headers=keyed)
        message = await error_of(resp, 429, "rate_limited")
        assert "max_tenant_backlog 1" in message and resp.headers["x-request-id"]
        (refused,) = [r for r in world.results.values() if r.status == "failed"]
        assert refused.error_code == "rate_limited" and refused.request_id.startswith(
            resp.headers["x-request-id"]
        )

        bob = asyncio.create_task(client.post(GEN, json=BODY, headers=BOB))  # bob's backlog is empty
        assert await until(lambda: sched.machine.backlog.count("bob") == 1, 10.0)

        await world.add_executor("sim-0", profile())
        for call in (first, second, bob):
            await ok(call)
        # The key was given back with the 429: the retry is a new call, and now it fits.
        body = await ok(client.post(GEN, json=BODY, headers=keyed))
        assert body["id"] != resp.headers["x-request-id"]
        assert (await ok(client.post(GEN, json=BODY, headers=keyed)))["id"] == body["id"]  # a replay now
    assert await until(lambda: sched.intake.handles == {}, 5.0)


async def test_a_tenant_over_its_gpu_second_quota_gets_429_until_the_window_ends(world):
    # Alice's refusal, bob's three calls and her second refusal must all fall in one window: 10 s
    # leaves room for a loaded machine (they take 1-3 s on an idle one).
    window = 10
    await world.start_registry()
    sched = await world.start_scheduler(view_s=0.1)
    sched.vtimes.window_refresh_s = 0.1
    await world.add_executor("sim-0", profile(default_s=0.05))  # 5 nodes: 0.25 GPU-s a request
    cfg = GatewayConfig(tenant_gpu_s=0.2, quota_window_s=window, request_timeout_s=30)
    async with gateway(world, cfg) as client:
        assert await world.redis.get(world.keys.quota_window) == str(window).encode()
        resp = await client.put("/v1/admin/tenants/bob/limits", json={"gpu_s": 0}, headers=ADMIN)
        assert resp.status == 200 and (await resp.json())["gpu_s"]["limit"] == 0  # bob: no quota
        resp = await client.put("/v1/admin/tenants/bob/limits", json={"gpu_s": -1}, headers=ADMIN)
        assert resp.status == 422
        resp = await client.put("/v1/admin/tenants/bob/limits", json={"gpu_s": 0}, headers=ALICE)
        assert resp.status == 403

        await elapse(
            window - time.time() % window + 0.05,
            because="the quota counts per wall-clock window: the test starts as one has just begun",
        )
        index = int(time.time() // window)
        refused = None
        while refused is None and time.time() < (index + 1) * window - 0.3:
            resp = await client.post(GEN, json=BODY, headers=ALICE)
            if resp.status == 429:
                refused = resp
            else:
                assert resp.status == 200, await resp.text()
        assert refused is not None, "alice was never refused within the window"
        message = await error_of(refused, 429, "quota_exceeded")
        assert f"quota of 0.2 GPU-seconds per {window} s" in message
        assert 1 <= int(refused.headers["Retry-After"]) <= window
        used = float(await world.redis.hget(world.keys.gpu_window(window, index), "alice"))
        assert used >= 0.2
        for _ in range(3):  # bob's override: he is never refused, however much he uses
            await ok(client.post(GEN, json=BODY, headers=BOB))
        limits = await (await client.get("/v1/admin/tenants/alice/limits", headers=ADMIN)).json()
        assert limits["gpu_s"]["limit"] == 0.2 and limits["gpu_s"]["used"] >= 0.2

        resp = await client.post(GEN, json=BODY, headers=ALICE)  # still this window: still refused
        await error_of(resp, 429, "quota_exceeded")
        await elapse(
            (index + 1) * window - time.time() + 0.05,
            because="a tenant's quota is renewed only when its window ends and the next begins",
        )
        await ok(client.post(GEN, json=BODY, headers=ALICE))  # a new window
