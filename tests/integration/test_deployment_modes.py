"""Each deployment mode end to end (docs/scheduling.md, "Deployment modes (baselines)"): registry,
scheduler, gateway and two simulated executors as processes over the real NATS and Redis, the mode
set once, for the scheduler only (``T2I_SCHEDULER_DEPLOYMENT``): the executors cache weights at the
mode's granularity because the scheduler's dispatches name it.

Two workflows, ``a-wf`` and ``b-wf``, share all four models of one family. Four requests run one
after the other (a, a, b, b); every node's completion is read off the bus, so the test sees where
each node ran and which nodes loaded their model (``load_frac`` > 0, load tier ``host``):

* ours: nodes spread over the executors (the two roots run at once), models stay cached;
* NoCache: each request on one executor, loading every one of its models;
* WCache: each request on one executor; the second request of a workflow goes where it is cached
  and loads nothing, but ``b-wf`` loads its own copies (no sharing across workflows);
* MCache: each request on one executor; only the first request loads: ``b-wf`` finds the shared
  models on the executor ``a-wf`` used.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import nats
import pytest
from redis.asyncio import Redis

from libs.launcher.stack import Stack
from libs.protocol.keys import Keys
from libs.protocol.messages import ExecutorGoodbye, NodeComplete, sched_decoder
from libs.protocol.subjects import Subjects
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.conftest import cleanup_namespace, free_port
from tests.integration.test_gateway_stack import call
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

MODELS = 4  # text, prepare, dit, vae


def fig(v: float) -> dict:
    return {"value": v, "tag": "D", "source": "test profile"}


def write_profile(path: Path) -> None:
    models = {
        f"fam/{part}": {"size_gb": fig(size), "load_s": fig(0.02), "exec_s": fig(0.005), "output_bytes": 1024}
        for part, size in (("text", 1.0), ("prepare", 0.1), ("dit", 2.0), ("vae", 0.5))
    }
    profile = {
        "name": "test-deploy",
        "description": "deployment modes",
        "device": "sim",
        "gpu_memory_gb": fig(8),
    }
    path.write_text(json.dumps({**profile, "models": models}))


async def run_mode(broker_urls, tmp: Path, mode: str) -> list[list[NodeComplete]]:
    """The completions of each of the four requests, in order."""
    nats_url, redis_url = broker_urls
    write_profile(tmp / "profile.json")
    stack = Stack(
        namespace="t" + uuid.uuid4().hex[:10],
        log_dir=tmp / "logs",
        model_root=tmp,
        gateway_port=free_port(),
        executors=0,
        sim_executors=2,
        sim_profile=str(tmp / "profile.json"),
        api_keys="sk-alice=alice,sk-ops=ops:admin",
        nats_url=nats_url,
        redis_url=redis_url,
        scheduler_env={"T2I_SCHEDULER_DEPLOYMENT": mode},
    )
    executors = {i for ids in stack.executor_ids().values() for i in ids}
    events: dict[str, list[NodeComplete]] = {}
    goodbyes: set[str] = set()
    nc = await nats.connect(nats_url)
    redis = Redis.from_url(redis_url)

    async def heard_from_all_since(t: float) -> bool:
        """Whether the scheduler has had a heartbeat from every executor since ``t`` (unix time),
        as its operator view of the executors (``{ns}:executors``, written each second) says."""
        view = await redis.hgetall(Keys(stack.namespace).executors_view)
        seen = {k.decode(): json.loads(v)["seen"] for k, v in view.items()}
        return all(seen.get(e, 0.0) > t for e in executors)

    try:

        async def on_event(msg) -> None:
            ev = sched_decoder.decode(msg.data)
            if isinstance(ev, NodeComplete):
                events.setdefault(ev.request_id, []).append(ev)
            elif isinstance(ev, ExecutorGoodbye):
                goodbyes.add(ev.executor)

        await nc.subscribe(Subjects(stack.namespace).sched_events, cb=on_event)
        await nc.flush()
        await asyncio.to_thread(stack.start)
        try:
            for name in ("a-wf", "b-wf"):
                spec = json.loads(encode_spec(sim_workflow(name, "fam", steps=3)))
                status, body = await asyncio.to_thread(
                    stack.http, "POST", "/v1/workflows", spec, key="sk-ops"
                )
                assert status == 201, body
            ids: list[str] = []
            ended = 0.0  # when the last request was answered (unix time)
            for model in ("a-wf", "a-wf", "b-wf", "b-wf"):
                if ids:
                    # Placed by what the executors cache after the last request, which their next
                    # heartbeats say: the scheduler handles an executor's events in the order it
                    # sent them, and had all completions of that request before it answered, so a
                    # heartbeat it had after that was sent after the executor's last node there.
                    heard = await until(lambda t=ended: heard_from_all_since(t), 30.0, 0.1)
                    assert heard, "the scheduler heard from no executor since the last request"
                body = {"model": model, "prompt": "a fox"}
                done = await asyncio.to_thread(call, stack, "POST", "/v1/images/generations", body)
                ended = time.time()
                assert done.status == 200, done.body
                ids.append(done.body["id"])
        finally:
            await asyncio.to_thread(stack.stop)
            await cleanup_namespace(nats_url, redis_url, stack.namespace)
        # Each executor says goodbye as it stops, after its last completion, on the same connection
        # and subject, to the same subscription of ours: with every goodbye in, so is every completion.
        assert await until(lambda: goodbyes >= executors), f"goodbyes from {goodbyes} only"
    finally:
        await nc.close()
        await redis.aclose()
    by_gen = {gid: [] for gid in ids}
    for rid, evs in events.items():
        by_gen[rid.rsplit("-", 1)[0]] += evs
    return [by_gen[gid] for gid in ids]


def loads(evs: list[NodeComplete]) -> int:
    return sum(1 for e in evs if e.timing.load_frac > 0)


@pytest.mark.parametrize("mode", ["ours", "nocache", "wcache", "mcache"])
async def test_a_deployment_mode_end_to_end(broker_urls, tmp_path, mode: str) -> None:
    runs = await run_mode(broker_urls, tmp_path, mode)
    assert all(len(evs) == MODELS + 2 for evs in runs)  # text, prepare, 3 steps, vae
    placed = [{e.executor for e in evs} for evs in runs]
    assert all(e.timing.load_tier in ("", "host") for evs in runs for e in evs)
    assert all(e.timing.load_tier == "host" for evs in runs for e in evs if e.timing.load_frac > 0)
    per_request = [loads(evs) for evs in runs]
    if mode == "ours":
        assert len(placed[0]) == 2  # its two roots ran at once, on both executors
        assert per_request[0] == MODELS and sum(per_request[1:]) < 3 * MODELS  # models stay cached
        return
    assert all(len(p) == 1 for p in placed), placed  # monolithic: one executor per request
    if mode == "nocache":
        assert per_request == [MODELS] * 4  # every request loads every model
    elif mode == "wcache":
        assert per_request == [MODELS, 0, MODELS, 0]  # b-wf loads its own copies
        assert placed[1] == placed[0] and placed[3] == placed[2]  # routed to the cached workflow
    else:
        assert per_request == [MODELS, 0, 0, 0]  # b-wf hits a-wf's models
        assert placed[0] == placed[1] == placed[2] == placed[3]
