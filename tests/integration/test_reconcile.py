"""Executors reconcile their arena against the scheduler's live requests (``LiveAttempts``).

A lost end-of-request release (core NATS is at-most-once) or a scheduler that crashed before
sending it must not leak arena space until the hour-long sweep: the leader lists the attempts it
has in progress every ``reconcile_s``; an executor frees what it holds of any other attempt that
had no node there for ``reconcile_grace_s``. The list is fenced by the lease epoch like every order.
"""

from __future__ import annotations

import msgspec
import pytest

from libs.protocol.ids import AttemptRef
from libs.protocol.messages import Dispatch, LiveAttempts, ack_decoder, encode
from tests.integration.test_scheduler_faults import World, profile
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def world(common):
    async with World(common) as w:
        yield w


async def _hold_an_attempt(world: World, ex, rid: str, epoch: int = 5) -> None:
    """A made-up node (it fails), whose attempt the executor then holds until it is released."""
    d = Dispatch(rid, 1, "n", "tenant-a", "nope", "nope", {}, [], epoch=epoch)
    reply = await world.nc.request(world.subjects.executor(ex.id), encode(d), 10.0)
    assert ack_decoder.decode(reply.data).ok
    assert await until(lambda: ex.current is None), "the made-up node did not end"
    assert rid in ex._attempts


async def _broadcast(world: World, live: LiveAttempts | bytes) -> None:
    """Publish on ``exec.all`` and return once the executor has handled it."""
    data = live if isinstance(live, bytes) else encode(live)
    await world.nc.publish(world.subjects.executors_all, data)
    # Handshake: the executor handles its ``exec.all`` subscription one message at a time, in the
    # order this connection published them, and answers a malformed request there; once it has,
    # the list before it was handled (whatever it did or did not free is done).
    reply = await world.nc.request(world.subjects.executors_all, b"{}", timeout=10)
    ack = ack_decoder.decode(reply.data)
    assert not ack.ok and "malformed" in ack.error


async def test_an_attempt_the_scheduler_no_longer_lists_is_freed_after_the_grace(world):
    ex = await world.add_executor("sim-0", profile())
    await ex.nc.flush()
    await _hold_an_attempt(world, ex, "r1")
    await _hold_an_attempt(world, ex, "r2")

    ex.reconcile_grace_s = 60.0  # idle for less than the grace: kept whatever the list says
    await _broadcast(world, LiveAttempts([], epoch=5))
    assert {"r1", "r2"} <= set(ex._attempts)

    ex.reconcile_grace_s = 0.0
    await _broadcast(world, LiveAttempts(["r2/1"], epoch=4))  # a replaced scheduler's: ignored
    assert {"r1", "r2"} <= set(ex._attempts)
    await _broadcast(world, b'{"type":"live_attempts","attempts":["no-slash"],"epoch":5}')  # malformed
    assert {"r1", "r2"} <= set(ex._attempts)

    await _broadcast(world, LiveAttempts(["r2/1", "other/3"], epoch=5))
    assert "r1" not in ex._attempts and "r2" in ex._attempts
    assert AttemptRef("r2", 1) in ex._attempt_seen


async def test_the_leader_lists_its_requests_and_an_executor_drops_what_it_forgot(world):
    await world.start_registry()
    ex = await world.add_executor("sim-0", profile(default_s=0.5))
    ex.reconcile_grace_s = 0.5
    lists: list[LiveAttempts] = []

    async def collect(msg) -> None:
        m = msgspec.json.decode(msg.data)
        if m.get("type") == "live_attempts":
            lists.append(msgspec.json.decode(msg.data, type=LiveAttempts))

    await world.nc.subscribe(world.subjects.executors_all, cb=collect)
    sched = await world.start_scheduler(reconcile_s=0.2)
    await _hold_an_attempt(world, ex, "forgotten", epoch=sched.epoch)  # no scheduler knows it
    (rid,) = await world.submit(1)
    assert await until(lambda: any(f"{rid}/1" in m.attempts for m in lists), 10.0), lists[-3:]
    assert all(m.epoch == sched.epoch for m in lists)
    assert await until(lambda: "forgotten" not in ex._attempts), "not freed"
    results = await world.wait_results([rid], within_s=30.0)
    assert results[rid].status == "succeeded"  # the live request was never touched
