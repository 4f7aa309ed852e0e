"""Admission to the active set is fair (``services/scheduler/core/admission.py``): the real scheduler,
registry and simulated executors in this process, over real NATS and Redis.

With a small active set (``max_active``) and one tenant's backlog of 100 requests held by the
scheduler, a second tenant's single request is admitted at the next free slot and finishes while
most of the backlog is still waiting, instead of waiting in JetStream behind it; every request of
the backlog still completes. A queued request whose deadline passes is answered ``timeout``.
"""

from __future__ import annotations

import time
import uuid

import pytest

from libs.protocol.messages import ImageRequest, encode
from tests.integration.test_scheduler_faults import STEPS, WORKFLOW, World, profile, until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def world(common):
    async with World(common) as w:
        yield w


async def submit(world: World, tenant: str, n: int = 1, timeout_s: float = 300.0) -> list[str]:
    ids = []
    for _ in range(n):
        rid = f"{tenant}-{uuid.uuid4().hex[:12]}"
        req = ImageRequest(
            rid,
            tenant,
            WORKFLOW,
            world.version,
            {"prompt": "x", "seed": 0, "num_inference_steps": STEPS},
            submitted_at=time.time(),
            timeout_s=timeout_s,
        )
        await world.js.publish(world.subjects.intake, encode(req), headers={"Nats-Msg-Id": rid})
        ids.append(rid)
    return ids


async def test_a_second_tenants_request_is_admitted_ahead_of_the_first_tenants_backlog(world):
    await world.start_registry()
    sched = await world.start_scheduler(max_active=4, max_backlog=500)
    a_ids = await submit(world, "tenant-a", 100)

    async def all_pulled() -> bool:  # the whole backlog is held by the scheduler, none in JetStream
        held = len(sched.machine.backlog) + sched.core.active
        return held == 100 and (await world.consumer()).num_pending == 0 and sched.intake.pending == 0

    # No executor yet, so nothing drains however slow this machine is: 4 in the core, 96 held.
    assert await until(all_pulled, 10.0)
    assert len(sched.machine.backlog) == 96 and sched.core.active == 4
    (b_id,) = await submit(world, "tenant-b")
    for i in range(2):
        await world.add_executor(f"sim-{i}", profile({"dit": 0.04}))
    assert await until(lambda: b_id in world.results, 30.0), "tenant b was not served"
    a_done = sum(1 for r in a_ids if r in world.results)
    assert world.results[b_id].status == "succeeded", world.results[b_id]
    assert a_done <= 20, f"tenant b waited for {a_done} of tenant a's requests"

    results = await world.wait_results(a_ids, within_s=60.0)
    assert sorted(results) == sorted(a_ids), f"lost {len(set(a_ids) - set(results))}"
    assert {r.status for r in results.values()} == {"succeeded"}
    assert await until(lambda: len(sched.machine.backlog) == 0 and sched.core.active == 0, 5.0)
    info = await world.consumer()
    assert info.config.max_ack_pending == 2 * (4 + 500)
    assert await until(lambda: sched.intake.handles == {}, 5.0)


async def test_a_request_whose_deadline_passes_while_queued_is_answered_timeout(world):
    await world.start_registry()
    sched = await world.start_scheduler(max_active=1)
    ex = await world.add_executor("sim-0", profile({"dit": 0.5}))  # ~1.1 s a request
    (first,) = await submit(world, "tenant-a")
    assert await until(lambda: sched.core.active == 1, 5.0)
    (late,) = await submit(world, "tenant-a", timeout_s=0.5)
    results = await world.wait_results([late], within_s=5.0)
    assert results[late].status == "failed" and results[late].error_code == "timeout", results[late]
    assert "queued for admission" in results[late].error
    assert first not in world.results  # answered while the first still ran, not after it
    results = await world.wait_results([first], within_s=10.0)
    assert results[first].status == "succeeded"
    assert ex.nodes_run == 2 + STEPS + 1  # nothing of the late one ran
