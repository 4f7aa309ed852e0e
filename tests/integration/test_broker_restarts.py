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
import redis

from libs.launcher.stack import Stack
from libs.protocol.keys import Keys
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.support.http import generate
from tests.support.stacks import sim_stack, started
from tests.support.waiting import elapse_sync, until_sync

pytestmark = pytest.mark.timeout(180)

REQUESTS = 12
DOWN_S = 3.0
RETRYABLE = (0, 429, 502, 503, 504)


def call(stack: Stack, body: dict, key: str, timeout: float) -> tuple[int, dict]:
    return generate(stack.url, stack.api_keys.split(",")[0].split("=")[0], body, key, timeout)


def in_flight(stack: Stack) -> tuple[int, int]:
    """(image requests the scheduler has taken in, those of them with a node done and not ended)."""
    r = redis.Redis.from_url(stack.redis_url)
    try:
        taken = running = 0
        for key in r.scan_iter(match=Keys(stack.namespace).request("*"), count=1000):
            attempt, done, status = r.hmget(key, "attempt", "nodes_done", "status")
            if attempt:
                taken += 1
                if int(done or 0) > 0 and status not in (b"succeeded", b"failed", b"cancelled"):
                    running += 1
        return taken, running
    finally:
        r.close()


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
        elapse_sync(0.05, because="the requests arrive 50 ms apart, not all at once")

    def running() -> bool:  # every request reached the scheduler, and some run on the executors
        taken, busy = in_flight(stack)
        return taken == REQUESTS and busy > 0

    assert until_sync(running, 30), f"the requests are not in flight: {in_flight(stack)}"
    down = stack.restart_nats(DOWN_S)
    for t in threads:
        t.join(90)

    answered = [i for i, r in enumerate(first) if r is not None and r[0] == 200]
    recovered, failed, vanished = [], [], []
    deadline = time.monotonic() + 60
    for i in range(REQUESTS):
        if i in answered:
            continue
        last: list[tuple[int, dict]] = []

        def settled(i: int = i, last: list = last) -> bool:
            # The same call again, by its key: the stored result, or a wait for it.
            last[:] = [call(stack, bodies[i], keys[i], timeout=30)]
            return last[0][0] not in RETRYABLE

        until_sync(settled, max(0.0, deadline - time.monotonic()), step=1.0)
        status, body = last[0]
        if status == 200:
            recovered.append(i)
        else:  # failed for good, or still no answer after the deadline
            (failed if body.get("error") else vanished).append((i, status, body))
    print(
        f"\nnats down {down:.1f} s with {REQUESTS} requests in flight: {len(answered)} answered, "
        f"{len(recovered)} recovered by their Idempotency-Key, {len(failed)} failed, {len(vanished)} vanished"
    )
    assert not vanished, (vanished, stack.tail("gateway"), stack.tail("scheduler"))
    assert not failed, (failed, stack.tail("scheduler"))
    assert len(answered) + len(recovered) == REQUESTS
    assert all(p.poll() is None for p in stack.procs.values()), "a service died with the bus"
