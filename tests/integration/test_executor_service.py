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
