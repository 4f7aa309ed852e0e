"""Outages of the registry and of Redis: no call vanishes.

Each test runs a secured process stack (``Stack(secure=True)``: its own nats-server, per-role
users) with two simulated executors, and three tenants whose clients send calls with
``Idempotency-Key``s and repeat them as the gateway advises (``x-should-retry``, ``Retry-After``;
``tests/support/calls.py``). A fault is injected while calls are in flight and while more arrive.
Every answer a client gets must be clear (a 200 with its image, or an error status with an error
code and message: never a dropped connection, a hang or a bodiless 5xx), and every call must end
with its image once the fault is over. The figures (calls, attempts, first answers, final
outcomes, losses, seconds down) are printed (``pytest -s``) and recorded in each test's docstring.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path

import pytest
import redis

from libs.launcher.stack import Stack
from libs.protocol.keys import Keys
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.support.calls import Call, figures, start_call
from tests.support.stacks import sim_stack, started
from tests.support.supervise import Supervisor
from tests.support.waiting import elapse_sync, until_sync

pytestmark = pytest.mark.timeout(150)

ADMIN_KEY = "sk-out-ops"
TENANT_KEYS = ["sk-out-a", "sk-out-b", "sk-out-c"]
API_KEYS = ",".join([f"{ADMIN_KEY}=ops:admin", *(f"{k}=tenant-{k[-1]}" for k in TENANT_KEYS)])
REQUEST_TIMEOUT_S = 45  # the gateway's per-image deadline (the scheduler's too)
REGISTRY_DOWN_S = 30.0
REDIS_DOWN_S = 2.5


def make_stack(tmp_path: Path, redis_url: str, **more: object) -> Stack:
    return sim_stack(
        tmp_path,
        api_keys=API_KEYS,
        redis_url=redis_url,
        secure=True,
        gateway_env={"T2I_GATEWAY_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)},
        **more,  # type: ignore[arg-type]
    )


def register_workflow(stack: Stack) -> None:
    spec = json.loads(encode_spec(sim_workflow("sim-wf", "sd3-medium", steps=28)))
    status, body = stack.http("POST", "/v1/workflows", spec, key=ADMIN_KEY)
    assert status == 201, body


class Clients:
    """Calls from the tenants in turn, each run by its own thread until ``deadline``."""

    def __init__(self, stack: Stack, deadline_s: float, retry_5xx: bool = False) -> None:
        self.stack = stack
        self.retry_5xx = retry_5xx
        self.t0 = time.monotonic()
        self.deadline = self.t0 + deadline_s
        self.calls: list[Call] = []
        self.threads: list[threading.Thread] = []

    def send(self, phase: str, n: int = 1, gap_s: float = 0.0) -> None:
        for _ in range(n):
            i = len(self.calls)
            call = Call(
                TENANT_KEYS[i % len(TENANT_KEYS)],
                {"model": "sim-wf", "prompt": f"p{i}", "seed": i},
                f"k-{uuid.uuid4().hex}",
                phase,
            )
            self.calls.append(call)
            self.threads.append(
                start_call(self.stack.url, call, self.deadline, self.t0, retry_5xx=self.retry_5xx)
            )
            if gap_s:
                elapse_sync(gap_s, because="the calls of a phase arrive gap_s apart, not all at once")

    def send_at(self, phase: str, delays_s: list[float]) -> Iterator[threading.Timer]:
        """Calls sent ``delays_s`` from now, while this thread does something else (a restart)."""
        for d in delays_s:
            timer = threading.Timer(d, self.send, args=(phase,))
            timer.start()
            yield timer

    def join(self) -> None:
        for t in self.threads:
            t.join(max(1.0, self.deadline - time.monotonic() + 5))

    def report(self, what: str, down_s: float) -> dict[str, object]:
        out = figures(self.calls)
        print(f"\n{what}: down {down_s:.1f} s")
        for phase in dict.fromkeys(c.phase for c in self.calls):
            calls = [c for c in self.calls if c.phase == phase]
            print(f"  {phase:>7}: {figures(calls)}")
            paths = Counter(" > ".join(squeeze([a.label for a in c.attempts])) for c in calls)
            for path, n in paths.most_common():
                print(f"           {n} x {path}")
        print(f"  {'all':>7}: {out}")
        samples = {a.label: a.message for c in self.calls for a in c.attempts if not a.ok}
        for label, message in samples.items():
            print(f"  {label}: {message[:160]!r}")
        return out

    def problems(self) -> list[tuple[str, str, list[str]]]:
        """Calls that did not end with their image, or got an unclear answer on the way."""
        return [
            (c.phase, c.idempotency_key, [f"{a.at:.1f}s {a.label} {a.message[:80]}" for a in c.attempts])
            for c in self.calls
            if not c.succeeded or c.unclear
        ]


def squeeze(labels: list[str]) -> list[str]:
    """Runs of one answer as "label xN"."""
    out = []
    for label, run in groupby(labels):
        n = len(list(run))
        out.append(label if n == 1 else f"{label} x{n}")
    return out


def wait_for_log(stack: Stack, name: str, text: str, count: int, timeout: float) -> None:
    def logged() -> bool:
        if stack.read_log(name).count(text) >= count:
            return True
        assert stack.procs[name].poll() is None, stack.tail(name)
        return False

    assert until_sync(logged, timeout, step=0.1), f"{name} not ready after {timeout:.0f}s\n{stack.tail(name)}"


def taken_in(stack: Stack) -> int:
    """How many image requests the scheduler has taken in (queuing one counts its attempt up in
    its state), ended or not."""
    r = redis.Redis.from_url(stack.redis_url)
    try:
        keys = r.scan_iter(match=Keys(stack.namespace).request("*"), count=1000)
        return sum(1 for k in keys if r.hget(k, "attempt"))
    finally:
        r.close()


# -- the registry down for 30 s ------------------------------------------------------------------------
@pytest.fixture
def stack(broker_urls, tmp_path):
    with started(make_stack(tmp_path, broker_urls[1])) as s:
        yield s


def test_registry_down_30s(stack: Stack) -> None:
    """The registry is SIGKILLed while 12 calls run and stays down 30 s while 12 more arrive (one
    every 2.5 s); then it is started again and 3 more are sent.

    What clients see: nothing. Calls already taken in go on and end with their image (the
    scheduler caches workflow versions, which are immutable; neither it nor the executors need the
    registry to run them). A call made while the registry is down is looked up by the gateway,
    which, when no registry answers, uses the latest version it has seen of that workflow
    (``RegistryClient.get``), and the scheduler has that version cached: it runs as usual. A
    workflow neither has seen would get 503 ``unavailable`` (``Retry-After: 1``,
    ``x-should-retry: true``, the Idempotency-Key not used up) until the registry is back.

    Measured (2 shared cores): 27 calls, the registry down ~31 s (30 s, then its start). Before:
    12/12 answered 200 at once; during: 12/12 200 at once; after: 3/3 200. 27 attempts; 27
    succeeded, 0 failed, 0 lost; no service died. Before the gateway fell back on the version it
    had seen, each call made during the outage was answered 503 and repeated by its key once a
    second (4 to 31 times) until the registry was back. The test takes about 40 s.
    """
    register_workflow(stack)
    clients = Clients(stack, deadline_s=REGISTRY_DOWN_S + 40)
    clients.send("before", 12, gap_s=0.05)
    assert until_sync(lambda: taken_in(stack) >= 12, 30), "the first calls were not taken in"
    t_kill = time.monotonic()
    stack.kill("registry")
    for _ in range(12):  # 2.5 s apart: 30 s of calls while the registry is away
        clients.send("during")
        elapse_sync(REGISTRY_DOWN_S / 12, because="calls keep arriving through the 30 s the registry is away")
    stack.restart("registry")
    wait_for_log(stack, "registry", "registry ready", 2, timeout=30)
    down = time.monotonic() - t_kill
    clients.send("after", 3, gap_s=0.05)
    clients.join()

    out = clients.report("registry SIGKILLed and restarted", down)
    assert not clients.problems(), (clients.problems(), stack.tail("gateway"), stack.tail("scheduler"))
    before = [c for c in clients.calls if c.phase == "before"]
    assert all(c.first and c.first.ok for c in before), "calls taken in before the kill need no registry"
    during = [c for c in clients.calls if c.phase == "during"]
    assert all(c.first and c.first.ok for c in during), "the last seen version did not answer"
    assert out["lost"] == 0 and out["succeeded"] == len(clients.calls)
    assert all(p.poll() is None for p in stack.procs.values()), "a service died with the registry"


# -- Redis restarted ------------------------------------------------------------------------------------
@pytest.fixture
def redis_stack(broker_urls, tmp_path):
    # A private redis-server (AOF on, users in an ACL file), so the shared one is never touched.
    with started(make_stack(tmp_path, "", private_redis=True)) as s:
        yield s


def test_redis_restarted(redis_stack: Stack) -> None:
    """Redis (the stack's own, configured as compose's: append-only file, ACL file) is SIGKILLed
    while 12 calls run, kept down 2.5 s while 3 more arrive, and started again on the same port
    with the same files; then 3 more calls are sent. A supervisor starts any service that exits
    again, as compose's ``restart: unless-stopped`` does. Clients repeat a plain 500 too (with
    their key that is safe).

    What clients see: calls waiting for their result keep waiting (the gateway's fallback poll of
    Redis fails and is logged; the result comes over NATS) and get their image. Calls made during
    the outage get 503 ``unavailable`` (``Retry-After``, ``x-should-retry: true``, no internal
    address in the message), then their image when repeated. The leading scheduler cannot renew
    its 3 s lease within the outage: it steps down and starts again as a standby in the same
    process (``services/scheduler/__main__.py``), takes the lease when the old one expires, and the
    intake redelivers the requests it held.

    Measured (2 shared cores): 18 calls, Redis down 2.6 s. Before: 12/12 200 at once; during: 3/3
    503 ``unavailable`` 1-3 times, then 200; after: 3/3 200. 24 attempts; 18 succeeded, 0 failed,
    0 lost; the supervisor restarted nothing. Found on the way (fixed): the gateway answered the 12
    waiting calls 500 ``internal`` (a failed Redis poll ended the wait); the scheduler exited after
    stepping down; and compose's ACL file (``default`` reduced to PING) made the restarted Redis
    drop the workflow registered before (404 ``model_not_found``; ``Credentials.redis_aclfile``
    says why). The test takes about 15 s.
    """
    stack = redis_stack
    register_workflow(stack)
    clients = Clients(stack, deadline_s=REQUEST_TIMEOUT_S + 30, retry_5xx=True)
    with Supervisor(stack) as supervisor:
        clients.send("before", 12, gap_s=0.05)
        assert until_sync(lambda: taken_in(stack) >= 12, 30), "the first calls were not taken in"
        timers = list(clients.send_at("during", [0.3, 1.0, 1.7]))
        down = stack.restart_redis(REDIS_DOWN_S)
        for t in timers:
            t.join()
        # Redis is back for the gateway (its tenant view is read from Redis) before the last calls.
        back = until_sync(lambda: stack.http("GET", "/v1/admin/tenants", key=ADMIN_KEY)[0] == 200, 30)
        assert back, f"the gateway does not reach Redis again\n{stack.tail('gateway')}"
        clients.send("after", 3, gap_s=0.05)
        clients.join()

    out = clients.report("redis SIGKILLed and restarted", down)
    print(f"  restarted by the supervisor: {supervisor.restarts}")
    assert not clients.problems(), (clients.problems(), stack.tail("gateway"), stack.tail("scheduler"))
    assert out["lost"] == 0 and out["succeeded"] == len(clients.calls)
    assert all(p.poll() is None for p in stack.procs.values()), "a service is down after Redis came back"
    assert not [c for c in clients.calls if any(x.status == 500 for x in c.attempts)], "a 500 answer"
    assert not supervisor.restarts, f"processes exited: {supervisor.restarts}"
