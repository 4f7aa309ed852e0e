"""Scheduler fail-over (``docs/scheduling.md``, "Fail-over"): a lease in Redis and fencing tokens.

* two schedulers: the second waits as a standby; the leader crashes mid-way (its tasks cancelled,
  its NATS connection dropped, its lease left to expire); the standby leads within the lease TTL
  and a little, and every request gets exactly one successful result (a duplicate, if any, has the
  same status);
* a leader whose lease another has taken steps down (``run`` raises ``LeaseLost``), and so does one
  whose vTime write is refused, or whose dispatch an executor refuses, for a stale epoch;
* an executor refuses a dispatch with a lower epoch than one it has seen, and ignores such a
  release; the vTime script refuses a write with a stale epoch;
* the lease: one holder at a time, a new epoch per acquisition, renewal only by its holder.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest

from libs.protocol.messages import (
    STALE_EPOCH,
    Dispatch,
    ReleaseRequest,
    ack_decoder,
    encode,
    result_decoder,
)
from services.scheduler.effects import ChargeVTime
from services.scheduler.lease import Lease, LeaseLost
from services.scheduler.vtime_store import StaleEpoch, VTimeStore
from tests.integration.test_scheduler_faults import World, profile, until

pytestmark = pytest.mark.timeout(90)

TTL = 2.0


@pytest.fixture
async def world(common):
    async with World(common) as w:
        yield w


async def test_the_standby_takes_over_a_crashed_leader_and_every_request_gets_one_result(world):
    await world.start_registry()
    for i in range(3):
        await world.add_executor(f"sim-{i}", profile(default_s=0.05))
    settings = {"lease_ttl_s": TTL, "ack_wait_s": 2.0}
    leader = await world.start_scheduler(**settings)
    leader_run = world.tasks[-1]
    standby = await world.build_scheduler(**settings)
    standby_start = asyncio.create_task(standby.start())
    await asyncio.sleep(1.5)
    assert leader.leading and not standby_start.done() and not standby.leading

    every: dict[str, list[str]] = defaultdict(list)  # request id -> the status of each result

    async def on_result(msg) -> None:
        r = result_decoder.decode(msg.data)
        every[r.request_id].append(r.status)

    await world.nc.subscribe(world.subjects.result("*"), cb=on_result)
    ids = []
    for _ in range(10):
        ids += await world.submit(1, tenant="tenant-a") + await world.submit(1, tenant="tenant-b")
    assert await until(lambda: len(every) >= 4, 30.0), "the leader answered nothing"

    answered_by_leader = set(every)
    # The crash: nothing more from the leader (no renewal, keep-alive, ack, dispatch), lease kept.
    crashed_at = time.monotonic()
    leader_run.cancel()
    for t in [*leader._tasks, *leader._finishing, *leader.intake.taking.values()]:  # noqa: SLF001
        t.cancel()
    # Its loops end before its connection goes (nats-py turns a cancelled fetch on a closed
    # connection into ConnectionClosedError, which the pull loop would retry for ever).
    await asyncio.gather(leader_run, return_exceptions=True)
    await leader.nc.close()
    world.scheduler = standby  # stopped at the end of the test instead

    await asyncio.wait_for(standby_start, TTL + 5.0)
    took = time.monotonic() - crashed_at
    world._run(standby.run())  # noqa: SLF001
    assert standby.leading and standby.epoch == leader.epoch + 1
    assert took <= TTL + 3.0, f"took over after {took:.1f}s"

    assert await until(lambda: all(r in every for r in ids), 60.0), f"lost {set(ids) - set(every)}"
    await asyncio.sleep(0.5)  # late duplicates, if any
    assert set(every) == set(ids)
    for rid, statuses in every.items():
        assert set(statuses) == {"succeeded"}, (rid, statuses)
    # Those the leader held when it crashed came back to the standby (its take-in counts attempts).
    retaken = [rid for rid in set(ids) - answered_by_leader if await _attempt(world, rid) >= 2]
    assert retaken, "no request the crashed leader held was taken over"


async def _attempt(world: World, rid: str) -> int:
    return int(await world.redis.hget(world.keys.request(rid), "attempt") or 0)


async def test_a_leader_whose_lease_is_taken_steps_down(world):
    sched = await world.start_scheduler(lease_ttl_s=1.5)
    run = world.tasks[-1]
    assert sched.leading
    await world.redis.set(world.keys.scheduler_lease, "another-scheduler", px=10_000)
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(run, 3.0)
    assert not sched.leading
    await sched.stop()  # its lease is not its own: the other's stays
    assert await world.redis.get(world.keys.scheduler_lease) == b"another-scheduler"
    world.scheduler = None


@pytest.mark.parametrize("told_by", ["vtime", "executor"])
async def test_a_leader_told_its_epoch_is_stale_steps_down(world, told_by):
    await world.start_registry()
    ex = await world.add_executor("sim-0", profile())
    sched = await world.start_scheduler(lease_ttl_s=30.0)  # its renewals keep working
    run = world.tasks[-1]
    if told_by == "vtime":  # another took the lease (the key is still this one's: not noticed yet)
        await world.redis.incr(world.keys.scheduler_epoch)
    else:  # an executor has seen a newer scheduler
        ex.epoch = sched.epoch + 1
    await world.submit(1)
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(run, 10.0)
    assert not sched.leading
    world.scheduler = None
    await sched.stop()


def _dispatch(rid: str, epoch: int) -> Dispatch:
    return Dispatch(rid, 1, "n", "tenant-a", "nope", "nope", {}, [], epoch=epoch)


async def test_an_executor_refuses_a_dispatch_and_ignores_a_release_from_a_replaced_scheduler(world):
    ex = await world.add_executor("sim-0", profile())
    await ex.nc.flush()  # its subscriptions are in place at the server before we request
    subject = world.subjects.executor(ex.id)
    ack = ack_decoder.decode((await world.nc.request(subject, encode(_dispatch("r1", 5)), 2.0)).data)
    assert ack.ok and ex.epoch == 5
    assert await until(lambda: ex.current is None, 5.0)  # the made-up node ends (it fails)
    assert "r1" in ex._attempts  # noqa: SLF001 - its attempt is held until released

    stale = ack_decoder.decode((await world.nc.request(subject, encode(_dispatch("r2", 4)), 2.0)).data)
    assert not stale.ok and stale.error == STALE_EPOCH and ex.current is None

    await world.nc.publish(world.subjects.executors_all, encode(ReleaseRequest("r1", -1, epoch=4)))
    await world.nc.flush()
    await asyncio.sleep(0.2)
    assert "r1" in ex._attempts  # noqa: SLF001 - ignored
    await world.nc.publish(world.subjects.executors_all, encode(ReleaseRequest("r1", -1, epoch=5)))
    assert await until(lambda: "r1" not in ex._attempts, 2.0)  # noqa: SLF001

    newer = ack_decoder.decode((await world.nc.request(subject, encode(_dispatch("r3", 6)), 2.0)).data)
    assert newer.ok and ex.epoch == 6


async def test_the_vtime_script_refuses_a_stale_epoch(world):
    store = VTimeStore(world.redis, world.keys, epoch=1)
    await world.redis.set(world.keys.scheduler_epoch, 1)
    assert await store.apply(ChargeVTime("t", delta=1.0, ops=1)) == (1.0, 1, 0.0)
    await world.redis.set(world.keys.scheduler_epoch, 2)  # another scheduler took the lease
    with pytest.raises(StaleEpoch):
        await store.apply(ChargeVTime("t", delta=5.0, ops=1))
    assert await world.redis.hget(world.keys.vtime, "t") == b"1"  # unchanged
    store.epoch = 2
    assert await store.apply(ChargeVTime("t", delta=1.0)) == (2.0, 1, 0.0)


async def test_the_lease_has_one_holder_and_a_new_epoch_per_acquisition(world):
    a = Lease(world.redis, world.keys, 1.0, holder="a")
    b = Lease(world.redis, world.keys, 1.0, holder="b")
    assert await a.try_acquire() and a.epoch == 1
    assert not await b.try_acquire()
    assert await a.renew()
    await a.release()
    assert await b.try_acquire() and b.epoch == 2
    assert not await a.renew()  # not its own any more
    await a.release()  # a no-op: b keeps it
    assert await world.redis.get(world.keys.scheduler_lease) == b"b"
    await asyncio.sleep(1.2)  # b does not renew: it expires
    assert await a.try_acquire() and a.epoch == 3
