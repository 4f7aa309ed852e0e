"""Chaos with real executors: the images that come back after faults are the fault-free images.

A secured stack (its own nats-server, Redis ACL users) with two scheduler processes, the gateway,
the registry and three real executors running the tiny Flux workflow serves requests from three
tenants, each sent with an ``Idempotency-Key`` from a thread of its own. While they run, one
executor process and then the leading scheduler are SIGKILLed and started again. Calls that broke
are repeated with their key. Every image must equal, pixel for pixel, the one the monolithic
diffusers ``FluxPipeline`` makes for the same prompt and seed — which is what a run without faults
returns (``test_generate_e2e.py`` checks that equality with no faults) — so whatever was re-run
(the lost nodes, or a whole request taken over by the new leader) computed the same bits.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis

from libs.launcher.stack import Stack
from libs.models.flux_workflows import tiny_flux
from libs.protocol.keys import Keys
from libs.workflow.spec import encode_spec
from tests.conftest import free_port
from tests.e2e.test_generate_e2e import monolithic, pixels
from tests.integration.test_chaos import RETRYABLE, leader
from tests.support.http import generate
from tests.support.stacks import started
from tests.support.waiting import elapse_sync, until_sync

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TENANTS = 3
REQUESTS = 12
STEPS = 6
SEED = 20261201


@pytest.fixture
def stack(broker_urls, tiny_models, tmp_path):
    _, redis_url = broker_urls
    s = Stack(
        namespace="t" + uuid.uuid4().hex[:10],
        log_dir=tmp_path / "logs",
        model_root=tiny_models,
        gateway_port=free_port(),
        executors=3,
        schedulers=2,
        api_keys=",".join(["sk-real-admin=ops:admin"] + [f"sk-real-{t}=tenant-{t}" for t in range(TENANTS)]),
        redis_url=redis_url,
        secure=True,
        scheduler_env={"T2I_SCHEDULER_LEASE_TTL_S": "2", "T2I_SCHEDULER_ACK_WAIT_S": "3"},
        gateway_env={"T2I_GATEWAY_REQUEST_TIMEOUT_S": "150"},
    )
    with started(s, timeout=120):
        yield s


def test_images_after_an_executor_and_the_leader_are_killed_equal_the_fault_free_ones(
    stack: Stack, tiny_models
) -> None:
    r = redis.Redis.from_url(stack.redis_url)
    keys = Keys(stack.namespace)
    rng = random.Random(SEED)
    spec = json.loads(encode_spec(tiny_flux()))
    assert stack.http("POST", "/v1/workflows", spec, key="sk-real-admin")[0] == 201
    first_leader = leader(stack, r)

    jobs = [
        (i % TENANTS, {"model": "tiny-flux", "prompt": f"a harbour, take {i}", "seed": 100 + i,
                       "num_inference_steps": STEPS, "size": "64x64"}, f"real-{uuid.uuid4().hex}")
        for i in range(REQUESTS)
    ]  # fmt: skip
    answers: list[tuple[int, dict] | None] = [None] * REQUESTS
    repeats = [0] * REQUESTS

    def submit(i: int) -> None:
        tenant, body, idem = jobs[i]

        def answered() -> bool:
            if answers[i] is not None:
                repeats[i] += 1  # the same call again, by its key: the same request
            status, out = generate(stack.url, f"sk-real-{tenant}", body, idem, timeout=150)
            answers[i] = (status, out)
            return status not in RETRYABLE

        # Repeated while it breaks; one still broken after 200 s fails the status check below.
        until_sync(answered, 200, step=0.5)

    faults: list[str] = []
    with ThreadPoolExecutor(REQUESTS) as pool:
        futures = [pool.submit(submit, i) for i in range(REQUESTS)]
        # The faults: once some denoising has happened (a request's first nodes are done), kill
        # an executor in mid-request; a little later, the leading scheduler.
        t0 = time.monotonic()
        assert until_sync(lambda: _any_progress(r, keys), 60, step=0.1), "no request finished a node"
        elapse_sync(rng.uniform(0.2, 1.0), because="the chaos schedule: a seeded-random moment mid-request")
        victim = f"executor-{rng.randrange(3)}"
        stack.restart(victim)
        faults.append(f"{victim} at {time.monotonic() - t0:.1f}s")
        elapse_sync(
            rng.uniform(0.5, 1.5), because="the chaos schedule: the leader a seeded-random while later"
        )
        first = leader(stack, r)
        stack.restart(first)
        faults.append(f"{first} (leader) at {time.monotonic() - t0:.1f}s")
        for f in futures:
            f.result()

    statuses = [a[0] if a else None for a in answers]
    assert all(s == 200 for s in statuses), (statuses, [a[1] for a in answers if a and a[0] != 200])
    assert first_leader in stack.procs
    attempts = []
    for i, (_, body, _) in enumerate(jobs):
        out = answers[i][1]  # type: ignore[index]
        got = pixels(out["data"][0]["b64_json"])
        want = monolithic(tiny_models, body["prompt"], seed=body["seed"], steps=STEPS, width=64, height=64)
        assert want.std() > 0
        assert np.array_equal(got, want), f"request {i} ({out['id']}): image differs after faults"
        attempts.append(int(r.hget(keys.request(f"{out['id']}-0"), "attempt") or 0))
    print(
        f"\nreal chaos: {REQUESTS} requests, {TENANTS} tenants, faults: {', '.join(faults)}; "
        f"{sum(repeats)} calls repeated; attempts per request {attempts}; all {REQUESTS} images "
        "equal the fault-free ones; lost 0"
    )
    r.close()


def _any_progress(r: redis.Redis, keys: Keys) -> bool:
    """Whether any image request of the stack has finished a node (its request hash says so)."""
    for key in r.scan_iter(match=keys.request("*"), count=500):
        if int(r.hget(key, "nodes_done") or 0) > 0:
            return True
    return False
