"""The executor service over real NATS, with a simulated runner and store (no torch): dispatches,
heartbeats, callback deliveries and releases, all keyed by the typed identifiers of
``libs.protocol.ids``."""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.common.jetstream import ensure_images_bucket
from libs.common.nats_conn import connect
from libs.protocol.ids import AttemptRef, NodeRef
from libs.protocol.messages import (
    CallbackReady,
    Dispatch,
    ExecutorHeartbeat,
    NodeComplete,
    OutputPlan,
    ReleaseRequest,
    ReleaseTensors,
    ack_decoder,
    encode,
    sched_decoder,
)
from libs.protocol.subjects import Subjects
from libs.protocol.tensor_meta import TensorMeta
from services.executor.service import ExecutorService
from services.executor.sim import SimRunner, SimStore
from tests.support.toyprofile import PROFILE

EXECUTOR = "sim-0"


async def until(condition, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture
async def executor(common):
    nc = await connect(common.nats_url, "test-executor")
    subjects = Subjects(common.namespace)
    events: list = []

    async def collect(msg) -> None:
        events.append(sched_decoder.decode(msg.data))

    sub = await nc.subscribe(subjects.sched_events, cb=collect)
    store = SimStore(EXECUTOR, 1 << 16)
    service = ExecutorService(
        executor_id=EXECUTOR,
        kind="sim",
        nc=nc,
        subjects=subjects,
        store=store,
        runner=SimRunner(PROFILE, store),
        images=await ensure_images_bucket(nc.jetstream(), subjects),
        fns=["toy.fn"],
        heartbeat_s=60,
    )
    await service.start()
    yield service, nc, subjects, events
    await service.stop()
    await sub.unsubscribe()
    await nc.close()


async def test_a_dispatched_node_completes_and_a_release_frees_its_attempt(executor) -> None:
    service, nc, subjects, events = executor
    node = NodeRef("r", 2, "n")
    d = Dispatch("r", 2, "n", "t", "toy.fn", "m", {}, [OutputPlan("a", 1), OutputPlan("b", 3)])
    ack = ack_decoder.decode((await nc.request(subjects.executor(EXECUTOR), encode(d), timeout=10)).data)
    assert ack.ok
    await until(lambda: any(isinstance(e, NodeComplete) for e in events))
    done = next(e for e in events if isinstance(e, NodeComplete))
    assert done.ref == node
    assert [m.tensor_id for m in done.outputs.values()] == [
        node.output("a").encode(),
        node.output("b").encode(),
    ]
    assert service.current is None and len(service.store._live) == 2  # noqa: SLF001
    await service.heartbeat()
    await until(lambda: sum(isinstance(e, ExecutorHeartbeat) for e in events) >= 2)
    beat = [e for e in events if isinstance(e, ExecutorHeartbeat)][-1]
    assert beat.resident == ["toy.fn|m"] and beat.running == []

    meta = TensorMeta("r/2/c/out", "peer", "tcp", "127.0.0.1:1", 0, 4, "uint8", [4])
    await nc.publish(subjects.executor(EXECUTOR), encode(CallbackReady("r", 2, "n", "control", meta)))
    other = CallbackReady("r", 3, "n", "control", meta)
    await nc.publish(subjects.executor(EXECUTOR), encode(other))
    await until(lambda: len(service.runner.callbacks) == 2)
    await nc.publish(subjects.executor(EXECUTOR), encode(ReleaseRequest("r")))  # every attempt held here
    await until(lambda: not service.store._live)  # noqa: SLF001
    assert len(service.runner.callbacks) == 1  # attempt 3 ran nothing here: kept until it is released
    await nc.publish(subjects.executor(EXECUTOR), encode(ReleaseRequest("r", 3)))
    await until(lambda: len(service.runner.callbacks) == 0)
    assert AttemptRef("r", 2) not in service._attempts.get("r", set())  # noqa: SLF001


async def test_peers_release_tensors_on_the_release_subject_only(executor) -> None:
    """``exec.<id>`` is the scheduler's (executors may not publish there); a consumer's
    ``ReleaseTensors`` goes to ``exec.<id>.release``, which takes nothing else."""
    service, nc, subjects, events = executor
    d = Dispatch("r", 1, "n", "t", "toy.fn", "m", {}, [OutputPlan("a", 1)])
    assert ack_decoder.decode((await nc.request(subjects.executor(EXECUTOR), encode(d), timeout=10)).data).ok
    await until(lambda: any(isinstance(e, NodeComplete) for e in events))
    tid = NodeRef("r", 1, "n").output("a").encode()
    assert tid in service.store._live  # noqa: SLF001
    await nc.publish(subjects.executor(EXECUTOR), encode(ReleaseTensors([tid])))  # refused there
    # A dispatch on the release subject is not one: nothing runs, nobody answers.
    d2 = Dispatch("r", 1, "n2", "t", "toy.fn", "m", {}, [OutputPlan("a", 1)])
    await nc.publish(subjects.executor_release(EXECUTOR), encode(d2))
    await nc.flush()
    await asyncio.sleep(0.3)
    assert tid in service.store._live and service.current is None  # noqa: SLF001
    assert sum(isinstance(e, NodeComplete) for e in events) == 1
    await nc.publish(subjects.executor_release(EXECUTOR), encode(ReleaseTensors([tid])))
    await until(lambda: tid not in service.store._live)  # noqa: SLF001
