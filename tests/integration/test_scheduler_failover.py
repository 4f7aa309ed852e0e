"""Scheduler fail-over (``docs/scheduling.md``, "Fail-over"): a lease in Redis and fencing tokens.

* two scheduler processes; the leader is SIGKILLed mid-way (a crash: its lease left to expire);
  the standby leads with the next epoch, and every request gets exactly one successful result
  (a duplicate, if any, has the same status);
* the leader's event loop stalls for twice the lease TTL (a blocking call, or a CPU-bound stretch
  holding the GIL between switches): the lease's keeper thread renews it meanwhile, so it keeps
  leading with the same epoch, the standby never leads, and every request gets one result;
* a scheduler process stopped with SIGTERM deletes its lease before it exits;
* a leader whose lease another has taken steps down and its process starts again as a standby,
  which leads again (a new epoch) once the other's lease runs out; so does one whose vTime write
  is refused, or whose dispatch an executor refuses, for a stale epoch;
* an executor refuses a dispatch with a lower epoch than one it has seen, and ignores such a
  release; the vTime script refuses a write with a stale epoch;
* the lease: one holder at a time, a new epoch per acquisition, renewal only by its holder; its
  keeper reports it lost once another holds it, or once Redis could not be reached for a TTL, and
  rides out a shorter outage.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import defaultdict

import pytest

from libs.common.redis_conn import connect_redis_sync
from libs.launcher.stack import Stack
from libs.protocol.messages import (
    STALE_EPOCH,
    Dispatch,
    ReleaseRequest,
    ack_decoder,
    encode,
    result_decoder,
)
from services.scheduler.core.effects import ChargeVTime
from services.scheduler.shell.lease import Lease
from services.scheduler.shell.vtime_store import StaleEpoch, VTimeStore
from tests.integration.test_scheduler_faults import Proxy, World, profile, until
from tests.support.waiting import elapse_sync

pytestmark = pytest.mark.timeout(120)

TTL = 2.0


@pytest.fixture
async def world(common):
    async with World(common) as w:
        yield w


class Results:
    """Every result published in the world's namespace: request id -> the status of each."""

    def __init__(self) -> None:
        self.every: dict[str, list[str]] = defaultdict(list)

    async def on_result(self, msg) -> None:
        r = result_decoder.decode(msg.data)
        self.every[r.request_id].append(r.status)

    async def subscribe(self, world: World) -> None:
        await world.nc.subscribe(world.subjects.result("*"), cb=self.on_result)

    async def exactly_one_each(self, world: World, ids: list[str], within_s: float) -> None:
        """Every request answered, ``succeeded``, and nothing else: once each has an answer, wait
        until the intake is drained (no scheduler holds a request any more, so no late duplicate
        can follow: World.drained)."""
        assert await until(lambda: all(r in self.every for r in ids), within_s), (
            f"no result for {set(ids) - set(self.every)}"
        )
        assert await until(world.drained, within_s), "the intake was not drained"
        assert set(self.every) == set(ids)
        for rid, statuses in self.every.items():
            assert set(statuses) == {"succeeded"}, (rid, statuses)


def _pid(holder: bytes | None) -> int | None:
    """The process id in a lease holder's id (``{host}-{pid}-{suffix}``)."""
    return None if holder is None else int(holder.decode().rsplit("-", 2)[1])


async def test_the_standby_process_takes_over_a_killed_leader_and_every_request_gets_one_result(
    world, tmp_path
):
    await world.start_registry()
    for i in range(3):
        await world.add_executor(f"sim-{i}", profile(default_s=0.05))
    procs = Stack(namespace=world.ns, log_dir=tmp_path / "logs", model_root=tmp_path, executors=0)
    env = {"T2I_SCHEDULER_LEASE_TTL_S": str(TTL), "T2I_SCHEDULER_ACK_WAIT_S": "2", "T2I_LOG_LEVEL": "INFO"}
    results = Results()
    await results.subscribe(world)
    try:
        leader = procs.spawn("scheduler-0", "services.scheduler", **env)
        holder = lambda: world.redis.get(world.keys.scheduler_lease)  # noqa: E731
        assert await until(lambda: _holds(holder, leader.pid), 60.0), procs.tail("scheduler-0")
        standby = procs.spawn("scheduler-1", "services.scheduler", **env)
        assert await until(lambda: "polling for it" in procs.read_log("scheduler-1"), 60.0)

        ids = []
        for _ in range(10):
            ids += await world.submit(1, tenant="tenant-a") + await world.submit(1, tenant="tenant-b")
        assert await until(lambda: len(results.every) >= 4, 30.0), procs.tail("scheduler-0")
        answered_by_leader = set(results.every)
        leader.send_signal(signal.SIGKILL)  # no renewal, keep-alive, ack or dispatch from now on
        leader.wait(10)

        assert await until(lambda: _holds(holder, standby.pid), 30.0), procs.tail("scheduler-1")
        assert int(await world.redis.get(world.keys.scheduler_epoch)) == 2
        await results.exactly_one_each(world, ids, 60.0)
        # Those the leader held when it was killed came back to the standby (its take-in counts
        # attempts).
        retaken = [rid for rid in set(ids) - answered_by_leader if await _attempt(world, rid) >= 2]
        assert retaken, "no request the killed leader held was taken over"
        assert standby.poll() is None and "stepping down" not in procs.read_log("scheduler-1")
    finally:
        procs.stop()


async def test_a_scheduler_process_stopped_by_sigterm_hands_its_lease_over_at_once(world, tmp_path):
    procs = Stack(namespace=world.ns, log_dir=tmp_path / "logs", model_root=tmp_path, executors=0)
    try:
        # A TTL far longer than the test: the key can only be gone because the leader deleted it.
        proc = procs.spawn("scheduler", "services.scheduler", T2I_SCHEDULER_LEASE_TTL_S="300")
        holder = lambda: world.redis.get(world.keys.scheduler_lease)  # noqa: E731
        assert await until(lambda: _holds(holder, proc.pid), 60.0), procs.tail("scheduler")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0, procs.tail("scheduler")
        assert await holder() is None, "the lease was not released on a clean stop"
    finally:
        procs.stop()


async def _holds(holder, pid: int) -> bool:
    return _pid(await holder()) == pid


async def _attempt(world: World, rid: str) -> int:
    return int(await world.redis.hget(world.keys.request(rid), "attempt") or 0)


def _stall_sleeping(seconds: float) -> None:
    elapse_sync(seconds, because="a blocking call on the event loop (the GIL is released meanwhile)")


def _stall_computing(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # CPU-bound Python: the GIL is held, released only at switches
        pass


@pytest.mark.parametrize("stall", [_stall_sleeping, _stall_computing], ids=["sleeping", "computing"])
async def test_a_leader_whose_event_loop_stalls_for_twice_the_ttl_keeps_leading(world, stall):
    await world.start_registry()
    for i in range(3):
        await world.add_executor(f"sim-{i}", profile(default_s=0.05))
    leader = await world.start_scheduler(lease_ttl_s=TTL, ack_wait_s=2.0)
    standby = world.add_scheduler(lease_ttl_s=TTL, ack_wait_s=2.0)
    assert await until(lambda: standby.current is not None and standby.current.lease.epoch == 0, 10.0)
    results = Results()
    await results.subscribe(world)
    ids = []
    for _ in range(5):
        ids += await world.submit(1, tenant="tenant-a") + await world.submit(1, tenant="tenant-b")
    assert await until(lambda: len(results.every) >= 2, 30.0), "the leader answered nothing"

    renewals = leader.lease.renewals
    stall(2 * TTL)  # everything on this loop stops: both schedulers, the executors, this test

    assert leader.lease.renewals > renewals, "the keeper did not renew during the stall"
    await results.exactly_one_each(world, ids, 60.0)
    assert world.successions[0].current is leader and leader.leading and leader.epoch == 1
    assert not world.successions[0].stepped_down and not standby.leading
    assert int(await world.redis.get(world.keys.scheduler_epoch)) == 1


async def test_a_leader_whose_lease_is_taken_steps_down_and_leads_again_once_it_is_free(world):
    await world.start_registry()
    await world.add_executor("sim-0", profile())
    first = await world.start_scheduler(lease_ttl_s=1.5)
    process = world.successions[0]
    await world.redis.set(world.keys.scheduler_lease, "another-scheduler", px=3000)
    assert await until(lambda: process.stepped_down, 5.0), "the leader did not step down"
    assert not first.leading and process.stepped_down[0][0] == first.epoch
    # The same process waits as a standby, the other's lease untouched, and leads once it expires.
    assert await world.redis.get(world.keys.scheduler_lease) == b"another-scheduler"
    assert await until(lambda: process.leading, 10.0), "the process did not lead again"
    second = process.current
    assert second is not first and second.epoch == first.epoch + 1
    [rid] = await world.submit(1)
    assert (await world.wait_results([rid], 20.0))[rid].status == "succeeded"


@pytest.mark.parametrize("told_by", ["vtime", "executor"])
async def test_a_leader_told_its_epoch_is_stale_steps_down(world, told_by):
    await world.start_registry()
    ex = await world.add_executor("sim-0", profile())
    sched = await world.start_scheduler(lease_ttl_s=30.0)  # its renewals keep working
    process = world.successions[0]
    if told_by == "vtime":  # another took the lease (the key is still this one's: not noticed yet)
        await world.redis.incr(world.keys.scheduler_epoch)
    else:  # an executor has seen a newer scheduler
        ex.epoch = sched.epoch + 1
    await world.submit(1)
    assert await until(lambda: process.stepped_down, 10.0), "the leader did not step down"
    epoch, why = process.stepped_down[0]
    assert not sched.leading and epoch == sched.epoch and "refused" in why, why
    assert await until(lambda: process.current is not sched, 5.0)  # a fresh service: a standby


def _dispatch(rid: str, epoch: int) -> Dispatch:
    return Dispatch(rid, 1, "n", "tenant-a", "nope", "nope", {}, [], epoch=epoch)


async def test_an_executor_refuses_a_dispatch_and_ignores_a_release_from_a_replaced_scheduler(world):
    ex = await world.add_executor("sim-0", profile())
    await ex.nc.flush()  # its subscriptions are in place at the server before we request
    subject = world.subjects.executor(ex.id)
    ack = ack_decoder.decode((await world.nc.request(subject, encode(_dispatch("r1", 5)), 2.0)).data)
    assert ack.ok and ex.epoch == 5
    assert await until(lambda: ex.current is None, 5.0)  # the made-up node ends (it fails)
    assert "r1" in ex._attempts

    stale = ack_decoder.decode((await world.nc.request(subject, encode(_dispatch("r2", 4)), 2.0)).data)
    assert not stale.ok and stale.error == STALE_EPOCH and ex.current is None

    await world.nc.publish(world.subjects.executors_all, encode(ReleaseRequest("r1", -1, epoch=4)))
    # A request to the executor after the stale release, on the same connection: the executor
    # takes in its messages in order, so by its answer the release has been seen (and ignored).
    after = ack_decoder.decode((await world.nc.request(subject, encode(_dispatch("r2", 4)), 2.0)).data)
    assert not after.ok and "r1" in ex._attempts
    await world.nc.publish(world.subjects.executors_all, encode(ReleaseRequest("r1", -1, epoch=5)))
    assert await until(lambda: "r1" not in ex._attempts, 2.0)

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


class Lost:
    """An ``on_lost`` callback that remembers why, and an event to wait on."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = asyncio.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()


def _lease(world: World, holder: str, ttl_s: float, poll_s: float = 0.05) -> Lease:
    url = world.common.redis_url
    return Lease(lambda: connect_redis_sync(url, 0.5), world.keys, ttl_s, poll_s, holder=holder)


async def test_the_lease_has_one_holder_and_a_new_epoch_per_acquisition(world):
    a, b = _lease(world, "a", 30.0), _lease(world, "b", 30.0)
    a_lost, b_lost = Lost(), Lost()
    await a.acquire(a_lost)
    assert a.epoch == 1 and a.valid()
    taking = asyncio.create_task(b.acquire(b_lost))
    # b polls while a holds it: a's key stays a's until a gives it up.
    assert await until(lambda: b.polls >= 3, 5.0)
    assert not taking.done() and await world.redis.get(world.keys.scheduler_lease) == b"a"
    await a.release()
    await asyncio.wait_for(taking, 10.0)
    assert b.epoch == 2 and b.valid() and not a.held
    assert await world.redis.get(world.keys.scheduler_lease) == b"b"
    await b.release()
    assert await world.redis.get(world.keys.scheduler_lease) is None
    assert not a_lost.reasons and not b_lost.reasons  # clean stops are not losses


async def test_a_leases_keeper_renews_it_and_reports_it_lost_once_another_holds_it(world):
    lease, lost = _lease(world, "a", 0.6), Lost()
    await lease.acquire(lost)
    assert await until(lambda: lease.renewals >= 3, 10.0), "not renewed"
    assert lease.valid() and await world.redis.pttl(world.keys.scheduler_lease) > 0
    await world.redis.set(world.keys.scheduler_lease, "b", px=10_000)  # taken from under it
    await asyncio.wait_for(lost.event.wait(), 5.0)
    assert "no longer ours" in lost.reasons[0] and not lease.held and not lease.valid()
    await lease.wait_valid()  # returns at once: lost, nothing to wait for
    await lease.release()
    assert await world.redis.get(world.keys.scheduler_lease) == b"b"  # not deleted: not its own


async def _lease_through_a_proxy(world: World, ttl_s: float) -> tuple[Lease, Proxy]:
    host, port = world.common.redis_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    proxy = Proxy(host, int(port))
    await proxy.start()
    url = f"redis://127.0.0.1:{proxy.listen}/0"
    return Lease(lambda: connect_redis_sync(url, 0.5), world.keys, ttl_s, 0.05, holder="a"), proxy


async def test_a_lease_keeper_that_cannot_reach_redis_for_a_ttl_reports_the_lease_lost(world):
    lease, proxy = await _lease_through_a_proxy(world, 1.5)
    lost = Lost()
    try:
        await lease.acquire(lost)
        proxy.cut()  # Redis away for good, for this keeper
        await asyncio.wait_for(lost.event.wait(), 15.0)
        assert "could not be reached" in lost.reasons[0] and lease.failed_renewals >= 1
        assert not lease.held and not lease.valid()
    finally:
        await lease.release()
        await proxy.close()


async def test_a_lease_keeper_rides_out_a_redis_outage_shorter_than_the_ttl(world):
    lease, proxy = await _lease_through_a_proxy(world, 3.0)
    lost = Lost()
    try:
        await lease.acquire(lost)
        proxy.cut()
        # Restored as soon as a renewal has failed: at least 1.8 s before the TTL can run out (a
        # renewal is due every second, and a refused connection fails at once).
        assert await until(lambda: lease.failed_renewals >= 1, 10.0), "no renewal failed"
        proxy.restore()
        renewed = lease.renewals
        assert await until(lambda: lease.renewals > renewed, 10.0), "not renewed after the outage"
        assert lease.valid() and not lost.reasons and lease.epoch == 1
        assert await world.redis.get(world.keys.scheduler_lease) == b"a"
    finally:
        await lease.release()
        await proxy.close()
