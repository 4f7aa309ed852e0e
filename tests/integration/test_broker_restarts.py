"""Requests in flight when the bus goes down are not lost.

A secured stack (its own nats-server, so the test can crash and restart it) with two simulated
executors serves requests submitted with ``Idempotency-Key``s; the nats-server is SIGKILLed
mid-way and started again a few seconds later on the same port and JetStream store. Every request
ends with its image: the call answers, or, if its result was published while the bus was down,
the same call repeated with its key returns the stored result without new GPU work. The figures
(answered at once, recovered by key, failed, vanished) are printed for the record.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from libs.launcher.stack import Stack
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.support.http import generate
from tests.support.stacks import sim_stack, started

pytestmark = pytest.mark.timeout(180)

REQUESTS = 12
DOWN_S = 3.0


def call(stack: Stack, body: dict, key: str, timeout: float) -> tuple[int, dict]:
    return generate(stack.url, stack.api_keys.split(",")[0].split("=")[0], body, key, timeout)


@pytest.fixture
def stack(broker_urls, tmp_path):
    _, redis_url = broker_urls
    s = sim_stack(
        tmp_path,
        redis_url=redis_url,
        secure=True,
        gateway_env={"T2I_GATEWAY_REQUEST_TIMEOUT_S": "20"},
    )
    with started(s):
        yield s


def test_requests_in_flight_survive_a_nats_crash_and_restart(stack: Stack) -> None:
    spec = json.loads(encode_spec(sim_workflow("sim-wf", "sd3-medium", steps=28)))
    assert stack.http("POST", "/v1/workflows", spec)[0] == 201
    bodies = [{"model": "sim-wf", "prompt": f"p{i}", "seed": i} for i in range(REQUESTS)]
    keys = [f"k-{uuid.uuid4().hex}" for _ in range(REQUESTS)]
    first: list[tuple[int, dict] | None] = [None] * REQUESTS

    def submit(i: int) -> None:
        first[i] = call(stack, bodies[i], keys[i], timeout=60)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(REQUESTS)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    time.sleep(0.5)  # requests are running on the executors
    down = stack.restart_nats(DOWN_S)
    for t in threads:
        t.join(90)

    answered = [i for i, r in enumerate(first) if r is not None and r[0] == 200]
    recovered, failed, vanished = [], [], []
    deadline = time.monotonic() + 60
    for i in range(REQUESTS):
        if i in answered:
            continue
        while True:  # the same call again, by its key: the stored result, or a wait for it
            status, body = call(stack, bodies[i], keys[i], timeout=30)
            if status == 200:
                recovered.append(i)
                break
            if status not in (0, 429, 502, 503, 504) or time.monotonic() > deadline:
                (failed if body.get("error") else vanished).append((i, status, body))
                break
            time.sleep(1)
    print(
        f"\nnats down {down:.1f} s with {REQUESTS} requests in flight: {len(answered)} answered, "
        f"{len(recovered)} recovered by their Idempotency-Key, {len(failed)} failed, {len(vanished)} vanished"
    )
    assert not vanished, (vanished, stack.tail("gateway"), stack.tail("scheduler"))
    assert not failed, (failed, stack.tail("scheduler"))
    assert len(answered) + len(recovered) == REQUESTS
    assert all(p.poll() is None for p in stack.procs.values()), "a service died with the bus"
