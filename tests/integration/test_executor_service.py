"""The executor service over real NATS, with a simulated runner and store (no torch): dispatches,
heartbeats, callback deliveries and releases, all keyed by the typed identifiers of
``libs.protocol.ids``."""

from __future__ import annotations

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
from tests.support.waiting import until

EXECUTOR = "sim-0"


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
    assert await until(lambda: any(isinstance(e, NodeComplete) for e in events)), "no NodeComplete"
    done = next(e for e in events if isinstance(e, NodeComplete))
    assert done.ref == node
    assert [m.tensor_id for m in done.outputs.values()] == [
        node.output("a").encode(),
        node.output("b").encode(),
    ]
    assert service.current is None and len(service.store._live) == 2
    await service.heartbeat()
    assert await until(lambda: sum(isinstance(e, ExecutorHeartbeat) for e in events) >= 2), "no 2nd beat"
    beat = [e for e in events if isinstance(e, ExecutorHeartbeat)][-1]
    assert beat.resident == ["toy.fn|m"] and beat.running == []

    meta = TensorMeta("r/2/c/out", "peer", "tcp", "127.0.0.1:1", 0, 4, "uint8", [4])
    await nc.publish(subjects.executor(EXECUTOR), encode(CallbackReady("r", 2, "n", "control", meta)))
    other = CallbackReady("r", 3, "n", "control", meta)
    await nc.publish(subjects.executor(EXECUTOR), encode(other))
    assert await until(lambda: len(service.runner.callbacks) == 2), "callbacks not delivered"
    await nc.publish(subjects.executor(EXECUTOR), encode(ReleaseRequest("r")))  # every attempt held here
    assert await until(lambda: not service.store._live), "tensors not released"
    assert len(service.runner.callbacks) == 1  # attempt 3 ran nothing here: kept until it is released
    await nc.publish(subjects.executor(EXECUTOR), encode(ReleaseRequest("r", 3)))
    assert await until(lambda: len(service.runner.callbacks) == 0), "attempt 3 not released"
    assert AttemptRef("r", 2) not in service._attempts.get("r", set())


async def test_peers_release_tensors_on_the_release_subject_only(executor) -> None:
    """``exec.<id>`` is the scheduler's (executors may not publish there); a consumer's
    ``ReleaseTensors`` goes to ``exec.<id>.release``, which takes nothing else."""
    service, nc, subjects, events = executor
    d = Dispatch("r", 1, "n", "t", "toy.fn", "m", {}, [OutputPlan("a", 1)])
    assert ack_decoder.decode((await nc.request(subjects.executor(EXECUTOR), encode(d), timeout=10)).data).ok
    assert await until(lambda: any(isinstance(e, NodeComplete) for e in events)), "no NodeComplete"
    tid = NodeRef("r", 1, "n").output("a").encode()
    assert tid in service.store._live
    await nc.publish(subjects.executor(EXECUTOR), encode(ReleaseTensors([tid])))  # refused there
    # Handshake: the executor handles the messages of one subscription one at a time, in the order
    # this connection published them (the service shares it), so once a malformed request after the
    # ReleaseTensors on ``exec.<id>`` is answered, that ReleaseTensors was handled (and refused).
    probe = ack_decoder.decode((await nc.request(subjects.executor(EXECUTOR), b"{}", timeout=10)).data)
    assert not probe.ok and "malformed" in probe.error
    assert tid in service.store._live
    # A dispatch on the release subject is not one: nothing runs, nobody answers.
    d2 = Dispatch("r", 7, "n2", "t", "toy.fn", "m", {}, [OutputPlan("a", 1)])
    await nc.publish(subjects.executor_release(EXECUTOR), encode(d2))
    await nc.publish(subjects.executor_release(EXECUTOR), encode(ReleaseTensors([tid])))
    assert await until(lambda: tid not in service.store._live), "not released"
    # The release after it on the same subject and connection took effect, so the dispatch was
    # handled before it. Had it been accepted, it would be the current node until its run ended,
    # and its run records its attempt (kept until a release) before it ends: neither is there.
    assert service.current is None and service.nodes_run == 1
    assert AttemptRef("r", 7) not in service._attempts.get("r", set())
    assert sum(isinstance(e, NodeComplete) for e in events) == 1


async def test_a_dispatch_without_a_reply_subject_is_not_taken_and_the_executor_stays_free(executor) -> None:
    """Nobody could be told a reply-less dispatch runs: it is dropped (it used to leave the executor
    'busy' for good, refusing every later dispatch)."""
    service, nc, subjects, events = executor
    lost = Dispatch("r", 1, "lost", "t", "toy.fn", "m", {}, [OutputPlan("a", 1)])
    await nc.publish(subjects.executor(EXECUTOR), encode(lost))
    # The next dispatch on the same subject and connection is handled after it, and is taken.
    d = Dispatch("r", 1, "n", "t", "toy.fn", "m", {}, [OutputPlan("a", 1)])
    ack = ack_decoder.decode((await nc.request(subjects.executor(EXECUTOR), encode(d), timeout=10)).data)
    assert ack.ok, ack.error
    assert await until(lambda: any(isinstance(e, NodeComplete) for e in events)), "no NodeComplete"
    assert [e.node_id for e in events if isinstance(e, NodeComplete)] == ["n"] and service.nodes_run == 1


async def test_the_executor_caches_at_the_granularity_of_the_deployment_mode_its_dispatches_name(
    executor,
) -> None:
    """The scheduler tells executors its deployment mode in every dispatch: one with nothing cached
    yet takes the mode's granularity (MCache: whole models); once weights are cached a different
    mode leaves it as it is."""
    service, nc, subjects, events = executor
    assert service.runner.policy.granularity == "layer"  # nothing said yet: ServerlessT2I's own
    d = Dispatch("r", 1, "n", "t", "toy.fn", "m", {}, [OutputPlan("a", 0)], deployment="mcache")
    ack = ack_decoder.decode((await nc.request(subjects.executor(EXECUTOR), encode(d), timeout=10)).data)
    assert ack.ok
    assert await until(lambda: any(isinstance(e, NodeComplete) for e in events)), "no NodeComplete"
    assert service.runner.policy.granularity == "model" and service.runner.resident()
    again = Dispatch("r", 1, "n2", "t", "toy.fn", "m", {}, [OutputPlan("a", 0)], deployment="wcache")
    ack = ack_decoder.decode((await nc.request(subjects.executor(EXECUTOR), encode(again), timeout=10)).data)
    assert ack.ok
    assert await until(lambda: sum(isinstance(e, NodeComplete) for e in events) == 2), "no 2nd completion"
    assert service.runner.policy.granularity == "model"  # weights cached: unchanged (and a warning)


async def test_an_executor_whose_cache_mode_is_set_does_not_follow_the_scheduler(executor) -> None:
    service, nc, subjects, events = executor
    service.follow_deployment = False  # what T2I_EXECUTOR_CACHE_MODE set does (services/executor/__main__.py)
    d = Dispatch("r", 1, "n", "t", "toy.fn", "m", {}, [OutputPlan("a", 0)], deployment="nocache")
    ack = ack_decoder.decode((await nc.request(subjects.executor(EXECUTOR), encode(d), timeout=10)).data)
    assert ack.ok
    assert await until(lambda: any(isinstance(e, NodeComplete) for e in events)), "no NodeComplete"
    assert service.runner.policy.granularity == "layer"
