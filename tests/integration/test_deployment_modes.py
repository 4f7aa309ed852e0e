"""Each deployment mode end to end (docs/scheduling.md, "Deployment modes (baselines)"): registry,
scheduler, gateway and two simulated executors as processes over the real NATS and Redis, the mode
set once (``T2I_SCHEDULER_DEPLOYMENT``, which the executors read for their cache granularity).

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
import uuid
from pathlib import Path

import nats
import pytest

from libs.launcher.stack import Stack
from libs.protocol.messages import NodeComplete, sched_decoder
from libs.protocol.subjects import Subjects
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.conftest import cleanup_namespace, free_port
from tests.integration.test_gateway_stack import call

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
        extra_env={"T2I_SCHEDULER_DEPLOYMENT": mode},
    )
    events: dict[str, list[NodeComplete]] = {}
    nc = await nats.connect(nats_url)
    try:

        async def on_event(msg) -> None:
            ev = sched_decoder.decode(msg.data)
            if isinstance(ev, NodeComplete):
                events.setdefault(ev.request_id, []).append(ev)

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
            ids = []
            for model in ("a-wf", "a-wf", "b-wf", "b-wf"):
                body = {"model": model, "prompt": "a fox"}
                done = await asyncio.to_thread(call, stack, "POST", "/v1/images/generations", body)
                assert done.status == 200, done.body
                ids.append(done.body["id"])
                await asyncio.sleep(1.2)  # the executors' next heartbeats say what they cache now
            await nc.flush()
            await asyncio.sleep(0.3)
        finally:
            await asyncio.to_thread(stack.stop)
            await cleanup_namespace(nats_url, redis_url, stack.namespace)
    finally:
        await nc.close()
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
