"""Malformed messages on every subject the services listen on: no service crashes, none loses a
request, and each still serves a good one afterwards.

A stack of processes (registry, scheduler, gateway, two simulated executors) is started, a slow
request is put in flight through the gateway, and then ~2,000 malformed messages are published on
the intake stream, the registry's subjects (request/reply: each must be answered), each
executor's dispatch, release and broadcast subjects, each executor's event subject (so the
scheduler reads them as that executor's) and the results subject of the request in flight. They are mutations of valid
messages of every kind — each field in turn replaced by null, a wrong type, a 5,000-digit integer,
NaN/Infinity, a 10,000-deep list, an absurd string, or dropped — plus raw junk: empty, truncated,
not UTF-8, not JSON, a JSON scalar, deep nesting. Fencing tokens (``epoch``) are never mutated: a
well-formed message with a higher epoch is a *valid* order from a newer scheduler, which only the
scheduler's credentials may send (``test_credentials.py`` checks that no other user can).

Afterwards: every process is alive, the request that was in flight succeeded, a new request
succeeds, and the registry answers.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading

import msgspec
import nats
import pytest
import redis

from libs.launcher.stack import Stack
from libs.protocol import messages as m
from libs.protocol.keys import Keys
from libs.protocol.subjects import REGISTRY_OPS, Subjects
from libs.protocol.tensor_meta import TensorMeta
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.support.http import generate
from tests.support.stacks import sim_stack, started
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(180)

SEED = 7
BIG = "9" * 5000


@pytest.fixture
def stack(broker_urls, tmp_path):
    nats_url, redis_url = broker_urls
    s = sim_stack(
        tmp_path,
        nats_url=nats_url,
        redis_url=redis_url,
        extra_env={"T2I_EXECUTOR_ARENA_MB": "64"},
        gateway_env={"T2I_GATEWAY_REQUEST_TIMEOUT_S": "120"},
    )
    with started(s):
        yield s


def templates(ns: str, executor: str) -> list[m._Msg]:
    """One valid message of every kind that travels on the bus."""
    meta = TensorMeta("r-0:1:n:out", executor, "tcp", "127.0.0.1:1", 0, 16, "float32", [4], generation=1)
    timing = m.NodeTiming(load_s=0.1, exec_s=0.2)
    return [
        m.ImageRequest("r-fuzz-0", "tenant-a", "sim-wf", 1, {"prompt": "p", "seed": 1}, 1.7e9),
        m.Dispatch("r-fuzz-0", 1, "n", "tenant-a", "sim.denoise", "sd3-medium",
                   {"x": m.TensorInput(meta), "c": m.ConstInput(1.0)}, [m.OutputPlan("out", 1)]),
        m.ReleaseTensors(["r-0:1:n:out"]),
        m.ReleaseRequest("r-fuzz-0", 1),
        m.CallbackReady("r-fuzz-0", 1, "n", "x", meta),
        m.CancelNode("r-fuzz-0", 1, "n"),
        m.NodeComplete(executor, "r-fuzz-0", 1, "n", {"out": meta}, timing=timing),
        m.NodeFailed(executor, "r-fuzz-0", 1, "n", "boom", retryable=True, unreachable=executor),
        m.ExecutorHeartbeat(executor, "sim", "tcp", "127.0.0.1:1", ["sim.denoise"], seq=10**6),
        m.RequestResult("r-fuzz-0", "succeeded", {"image": m.ImageRef(f"{ns}-images", "x", 1, 8, 8)}),
    ]  # fmt: skip


_REPLACEMENTS: list[object] = [
    None, "x", -1, 1.5, [], {}, True, {"type": "nope"}, "∞" * 3000, BIG, "NaN", "Infinity", "DEEP"
]  # fmt: skip


def _render(obj: dict) -> bytes:
    text = json.dumps(obj)
    # Numbers JSON libraries refuse to write, written by hand: huge, NaN, infinite, deep.
    for token, raw in (('"' + BIG + '"', BIG), ('"NaN"', "NaN"), ('"Infinity"', "Infinity"),
                       ('"DEEP"', "[" * 10_000 + "]" * 10_000)):  # fmt: skip
        text = text.replace(token, raw, 1)
    return text.encode()


def mutations(msg: m._Msg, rng: random.Random) -> list[bytes]:
    """Malformed variants of ``msg``: each field replaced or dropped, then raw junk."""
    valid = json.loads(m.encode(msg))
    out: list[bytes] = []
    for key in valid:
        if key == "epoch":
            continue
        for value in _REPLACEMENTS:
            out.append(_render({**valid, key: value}))
        out.append(_render({k: v for k, v in valid.items() if k != key}))
    data = m.encode(msg)
    out += [
        b"", b"{", b"null", b"42", b'"a"', b"[]", b"\xff\xfe\x00", data[: len(data) // 2],
        b"[" * 50_000, data + b"garbage", json.dumps({"type": valid.get("type"), "x": 1}).encode(),
        bytes(rng.randrange(256) for _ in range(64)),
    ]  # fmt: skip
    return out


def test_malformed_messages_on_every_subject_crash_nothing_and_lose_nothing(stack: Stack) -> None:
    spec = json.loads(encode_spec(sim_workflow("sim-wf", "sd3-medium", steps=28)))
    assert stack.http("POST", "/v1/workflows", spec)[0] == 201
    api_key = stack.api_keys.split(",")[0].split("=")[0]
    body = {"model": "sim-wf", "prompt": "before", "seed": 1}
    in_flight: dict[str, tuple[int, dict]] = {}
    caller = threading.Thread(
        target=lambda: in_flight.setdefault("r", generate(stack.url, api_key, body, "fuzz-1", 120))
    )
    caller.start()

    sent, answered = asyncio.run(_fuzz(stack))

    caller.join(150)
    dead = {n: p.returncode for n, p in stack.procs.items() if p.poll() is not None}
    assert not dead, f"processes died: {dead}\n{stack.tail('scheduler')}"
    status, out = in_flight["r"]
    assert status == 200 and out["data"], (status, out)
    status, out = generate(stack.url, api_key, {**body, "prompt": "after"}, "fuzz-2", 120)
    assert status == 200 and out["data"], (status, out)
    assert stack.http("GET", "/v1/workflows")[0] == 200
    print(f"\nbus fuzz: {sent} malformed messages, {answered} registry replies; 0 crashes, 0 lost")


async def _fuzz(stack: Stack) -> tuple[int, int]:
    rng = random.Random(SEED)
    s = Subjects(stack.namespace)
    executors = [i for ids in stack.executor_ids().values() for i in ids]
    nc = await nats.connect(stack.nats_url)
    js = nc.jetstream()
    sent = answered = 0
    r = redis.Redis.from_url(stack.redis_url)
    waiting: list[str] = []

    def in_flight() -> bool:
        waiting[:] = [
            key.decode().rsplit(":", 1)[1]
            for key in r.scan_iter(match=Keys(stack.namespace).request("*"), count=1000)
            if r.hget(key, "status") not in (None, b"succeeded", b"failed")
        ]
        return bool(waiting)

    try:
        assert await until(in_flight, 30.0, 0.05), "no request in flight to aim results at"
    finally:
        r.close()
    try:
        for msg in templates(stack.namespace, executors[0]):
            for data in mutations(msg, rng):
                if isinstance(msg, m.ImageRequest):
                    await js.publish(s.intake, data)
                    subjects = []
                elif isinstance(msg, m.RequestResult):  # at the request the gateway waits for
                    subjects = [s.result(rid) for rid in waiting]
                elif isinstance(msg, m.ReleaseTensors):
                    subjects = [s.executor_release(e) for e in executors]
                elif isinstance(msg, m.NodeComplete | m.NodeFailed | m.ExecutorHeartbeat):
                    subjects = [s.executor_events(e) for e in executors]
                elif isinstance(msg, m.ReleaseRequest):
                    subjects = [s.executors_all, s.executor(executors[1])]
                else:  # Dispatch, CallbackReady, CancelNode
                    subjects = [s.executor(executors[1])]
                for subject in subjects:
                    await nc.publish(subject, data)
                sent += max(1, len(subjects))
            await nc.flush()
        for op in REGISTRY_OPS:
            for data in mutations(m.GetWorkflow("sim-wf"), rng)[:40]:
                reply = await nc.request(s.registry(op), data, timeout=10)
                answer = msgspec.json.decode(reply.data)
                assert isinstance(answer, dict) and answer.get("ok") is False, (op, data[:80], answer)
                answered += 1
                sent += 1
    finally:
        await nc.close()
    return sent, answered
