"""A node over the executor's time limit fails (retryable, so the scheduler runs it elsewhere): a
simulated executor cancels it and goes on serving; a runner whose node cannot be stopped (a thread
inside ``execute``) makes the executor end its run loop, so the process exits and its supervisor
restarts it. The scheduler's ``CancelNode`` does the same on request: at once for a simulated
runner, by a restart for a stuck one when the scheduler allows it (``restart_ok``); a cancel of a
node the executor is not running is ignored."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest

from libs.common.jetstream import ensure_images_bucket
from libs.common.nats_conn import connect
from libs.protocol.messages import (
    CancelNode,
    Dispatch,
    NodeComplete,
    NodeFailed,
    OutputPlan,
    ack_decoder,
    encode,
    sched_decoder,
)
from libs.protocol.subjects import Subjects
from libs.sim.profile import Figure, ModelProfile, Profile
from services.executor.service import ExecutorService
from services.executor.sim import SimRunner, SimStore
from tests.support.waiting import until

LIMIT_S = 0.3


def fig(v: float) -> Figure:
    return Figure(v, "P", "test")


PROFILE = Profile(
    name="limits",
    description="one model that runs for ever, one instant",
    device="sim",
    gpu_memory_gb=fig(10),
    models={
        "slow": ModelProfile(fig(1), fig(0.0), fig(3600.0), output_bytes=4096),
        "m": ModelProfile(fig(1), fig(0.0), fig(0.0), output_bytes=4096),
    },
)


class StuckRunner(SimRunner):
    """A runner whose node sits in a thread nobody can stop, as a hung ``execute`` does."""

    cancels_cleanly = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    async def run(self, d, blobs=None):
        await asyncio.to_thread(self.release.wait, 30)  # cancelling the await leaves the thread
        return await super().run(d, blobs)


async def service_with(common, runner_cls, limit_s: float = LIMIT_S) -> AsyncIterator[tuple]:
    nc = await connect(common.nats_url, "test-executor-limits")
    subjects = Subjects(common.namespace)
    events: list = []

    async def collect(msg) -> None:
        events.append(sched_decoder.decode(msg.data))

    sub = await nc.subscribe(subjects.sched_events, cb=collect)
    store = SimStore("sim-limit", 1 << 16)
    runner = runner_cls(PROFILE, store)
    service = ExecutorService(
        executor_id="sim-limit",
        kind="sim",
        nc=nc,
        subjects=subjects,
        store=store,
        runner=runner,
        images=await ensure_images_bucket(nc.jetstream(), subjects),
        fns=["toy.fn"],
        heartbeat_s=60,
        node_timeout_s=limit_s,
    )
    await service.start()
    try:
        yield service, runner, nc, subjects, events
    finally:
        if isinstance(runner, StuckRunner):
            runner.release.set()
        await service.stop()
        await sub.unsubscribe()
        await nc.close()


async def dispatch(nc, subjects, node: str, model: str) -> bool:
    d = Dispatch("r", 1, node, "t", "toy.fn", model, {}, [OutputPlan("out", 1)])
    reply = await nc.request(subjects.executor("sim-limit"), encode(d), timeout=10)
    return ack_decoder.decode(reply.data).ok


@pytest.fixture
async def simulated(common):
    async for x in service_with(common, SimRunner):
        yield x


@pytest.fixture
async def stuck(common):
    async for x in service_with(common, StuckRunner):
        yield x


@pytest.fixture
async def unlimited(common):
    """No time limit of its own: only the scheduler's CancelNode stops a node."""
    async for x in service_with(common, SimRunner, limit_s=0.0):
        yield x


@pytest.fixture
async def stuck_unlimited(common):
    async for x in service_with(common, StuckRunner, limit_s=0.0):
        yield x


def completed(events: list, node: str) -> bool:
    return any(isinstance(e, NodeComplete) and e.node_id == node for e in events)


async def cancel(nc, subjects, node: str, restart_ok: bool = False) -> None:
    await nc.publish(subjects.executor("sim-limit"), encode(CancelNode("r", 1, node, restart_ok)))
    await nc.flush()


async def test_a_simulated_node_over_the_limit_fails_retryably_and_the_executor_serves_on(simulated) -> None:
    service, _, nc, subjects, events = simulated
    assert await dispatch(nc, subjects, "n1", "slow")
    assert await until(lambda: any(isinstance(e, NodeFailed) for e in events)), "n1 never failed"
    failed = next(e for e in events if isinstance(e, NodeFailed))
    assert failed.node_id == "n1" and failed.retryable and "time limit" in failed.error

    assert await dispatch(nc, subjects, "n2", "m")  # cancelled cleanly: free again
    assert await until(lambda: completed(events, "n2")), "n2 never completed"


async def test_a_node_that_cannot_be_stopped_ends_the_executor_so_it_is_restarted(stuck) -> None:
    service, _, nc, subjects, events = stuck
    run = asyncio.create_task(service.run())
    assert await dispatch(nc, subjects, "n1", "m")
    assert await until(lambda: any(isinstance(e, NodeFailed) for e in events)), "n1 never failed"
    assert not await dispatch(nc, subjects, "n2", "m"), "a wedged executor accepted more work"
    with pytest.raises(RuntimeError, match="restarts this executor"):
        await asyncio.wait_for(run, 10)
    assert not any(isinstance(e, NodeComplete) for e in events)


async def test_an_attempt_whose_release_never_came_is_freed_after_its_ttl(simulated) -> None:
    service, runner, nc, subjects, events = simulated
    service.attempt_ttl_s = 60.0
    assert await dispatch(nc, subjects, "n1", "m")
    assert await until(lambda: completed(events, "n1")), "n1 never completed"
    store = service.store
    assert store.stats()["tensors"] == 1  # its output waits for a consumer (or the release)

    assert service.sweep_attempts(time.monotonic() + 30) == 0  # not idle long enough yet
    assert store.stats()["tensors"] == 1
    assert service.sweep_attempts(time.monotonic() + 61) == 1  # the release was lost: freed
    assert store.stats()["tensors"] == 0 and store.stats()["used"] == 0


async def test_a_never_ending_node_is_stopped_by_the_schedulers_cancel_and_the_executor_serves_on(
    unlimited,
) -> None:
    service, _, nc, subjects, events = unlimited
    assert await dispatch(nc, subjects, "n1", "slow")  # 3600 s, and no limit here
    assert await until(lambda: service.current is not None), "n1 never started"
    await cancel(nc, subjects, "other")  # not the node it runs: ignored
    await cancel(nc, subjects, "n1")
    # Nothing but the cancel can end n1 (an hour-long node, no time limit): its failure says so.
    assert await until(lambda: any(isinstance(e, NodeFailed) for e in events)), "n1 was not stopped"
    (failed,) = [e for e in events if isinstance(e, NodeFailed)]
    assert (failed.executor, failed.node_id) == ("sim-limit", "n1")
    assert failed.retryable and failed.error == "cancelled by the scheduler"
    assert service.cancelled == 1 and service.current is None

    assert await dispatch(nc, subjects, "n2", "m")  # stopped cleanly: free again
    assert await until(lambda: completed(events, "n2")), "n2 never completed"
    await cancel(nc, subjects, "n2")  # it finished already: nothing to stop
    # Handshake: the executor handles ``exec.<id>`` one message at a time, in the order this
    # connection published them, so n3 is accepted after the cancel of n2 was handled; n3 then
    # completing (not failing) and no second failure or cancel before it prove the cancel was ignored.
    assert await dispatch(nc, subjects, "n3", "m")
    assert await until(lambda: completed(events, "n3")), "n3 never completed"
    assert service.cancelled == 1 and sum(isinstance(e, NodeFailed) for e in events) == 1


async def test_a_cancel_the_runner_cannot_carry_out_restarts_the_executor_only_when_allowed(
    stuck_unlimited,
) -> None:
    service, _, nc, subjects, events = stuck_unlimited
    run = asyncio.create_task(service.run())
    assert await dispatch(nc, subjects, "n1", "m")
    assert await until(lambda: service.current is not None), "n1 never started"
    await cancel(nc, subjects, "n1")  # a request that ended: not worth a restart
    # Handshake: a dispatch published after the cancel on the same subject and connection is
    # answered after the cancel was handled (one message at a time); it is refused, n1 being busy.
    assert not await dispatch(nc, subjects, "probe", "m"), "a busy executor accepted more work"
    # Carrying the cancel out would have cancelled n1's work task at once, as the cancel was
    # handled: the task is still n1's, not done and never asked to stop.
    running = service._cancellable
    assert running is not None and running[0].node_id == "n1"
    assert not running[1].done() and not running[1].cancelling()
    assert not any(isinstance(e, NodeFailed) for e in events)
    assert not run.done() and service.current is not None
    await cancel(nc, subjects, "n1", restart_ok=True)  # over the scheduler's time limit
    assert await until(lambda: any(isinstance(e, NodeFailed) for e in events)), "n1 was not stopped"
    (failed,) = [e for e in events if isinstance(e, NodeFailed)]
    assert failed.retryable and failed.error == "cancelled by the scheduler"
    assert not await dispatch(nc, subjects, "n2", "m"), "a wedged executor accepted more work"
    with pytest.raises(RuntimeError, match="restarts this executor"):
        await asyncio.wait_for(run, 10)
