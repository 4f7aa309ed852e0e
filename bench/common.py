"""Helpers shared by the benchmarks that run the real services over simulated executors
(``bench/fairness.py``, ``bench/slo.py``): brokers, a :class:`~libs.launcher.stack.Stack` of
gateway, registry, scheduler and simulated executors, workflow registration, posting requests
through the gateway, and the executors' events read off the bus.

Importing this module puts the repository on ``sys.path`` (the benchmarks run as scripts).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from libs.launcher import brokers  # noqa: E402
from libs.launcher.stack import Stack  # noqa: E402
from libs.workflow.spec import WorkflowSpec, encode_spec  # noqa: E402

NATS_URL = "nats://127.0.0.1:4222"
REDIS_URL = "redis://127.0.0.1:6379/0"
# The gateway must not shed load: a benchmark measures the scheduler, not admission limits.
UNLIMITED_GATEWAY = {
    "T2I_GATEWAY_MAX_INFLIGHT": "100000",
    "T2I_GATEWAY_TENANT_INFLIGHT": "100000",
    "T2I_GATEWAY_REQUEST_TIMEOUT_S": "3600",
}


@contextmanager
def local_brokers(
    nats_url: str = NATS_URL, redis_url: str = REDIS_URL, workdir: Path | None = None
) -> Iterator[tuple[str, str]]:
    """NATS and Redis on their default local ports, started (and stopped after) where none answer."""
    started = brokers.ensure_brokers(
        nats_url, redis_url, workdir or REPO / "var" / "bench", log=lambda *_: None
    )
    try:
        yield nats_url, redis_url
    finally:
        brokers.stop(started)


def sim_stack(
    prefix: str,
    log_dir: Path,
    *,
    gpus: int,
    profile: str,
    time_scale: float,
    api_keys: str,
    nats_url: str = NATS_URL,
    redis_url: str = REDIS_URL,
    scheduler_env: dict[str, str] | None = None,
    extra_env: dict[str, str] | None = None,
    sim_heartbeat_s: float = 0.5,
) -> Stack:
    """A (not yet started) stack: the real gateway, registry and scheduler, ``gpus`` simulated
    executors of ``profile`` in one process, a fresh namespace ``prefix`` + random suffix."""
    from tests.conftest import free_port

    return Stack(
        namespace=prefix + uuid.uuid4().hex[:6],
        log_dir=log_dir,
        model_root=REPO / "models",
        gateway_port=free_port(),
        executors=0,
        sim_executors=gpus,
        sim_profile=profile,
        sim_time_scale=time_scale,
        sim_heartbeat_s=sim_heartbeat_s,
        api_keys=api_keys,
        nats_url=nats_url,
        redis_url=redis_url,
        scheduler_env=dict(scheduler_env or {}),
        gateway_env=dict(UNLIMITED_GATEWAY),
        extra_env=dict(extra_env or {}),
    )


@asynccontextmanager
async def running(stack: Stack):
    """Start ``stack`` (in a thread), yield it, then stop it and delete its namespace's state."""
    from tests.conftest import cleanup_namespace

    await asyncio.to_thread(stack.start)
    try:
        yield stack
    finally:
        await asyncio.to_thread(stack.stop)
        await cleanup_namespace(stack.nats_url, stack.redis_url, stack.namespace)


async def register(stack: Stack, specs: Iterable[WorkflowSpec], key: str) -> None:
    """Register each workflow through the gateway's HTTP API (``key`` must be an admin's)."""
    for spec in specs:
        status, body = await asyncio.to_thread(
            stack.http, "POST", "/v1/workflows", json.loads(encode_spec(spec)), key
        )
        if status != 201:
            raise RuntimeError(f"registering {spec.name}: HTTP {status} {body}")


@asynccontextmanager
async def client_session():
    """An HTTP session without connection or time limits (many requests wait at once)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as s:
        yield s


async def generate(
    http: aiohttp.ClientSession, stack: Stack, model: str, key: str, seed: int, prompt: str = "a lighthouse"
) -> tuple[int, float, dict[str, Any]]:
    """One image through the gateway: (HTTP status, wall seconds the client waited, the JSON body
    without the image bytes)."""
    t0 = time.monotonic()
    async with http.post(
        f"{stack.url}/v1/images/generations",
        json={"model": model, "prompt": prompt, "seed": seed},
        headers={"Authorization": f"Bearer {key}"},
    ) as resp:
        raw = await resp.read()
        waited = time.monotonic() - t0
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError:
        body = {}
    if isinstance(body, dict):
        body.pop("data", None)
    return resp.status, waited, body if isinstance(body, dict) else {}


@asynccontextmanager
async def bus_events(stack: Stack, on_event):
    """Call ``on_event(event)`` with every executor event (``NodeComplete``, ``NodeFailed``,
    ``ExecutorHeartbeat``, ...) of ``stack``'s namespace while the block runs."""
    import nats

    from libs.protocol.messages import sched_decoder
    from libs.protocol.subjects import Subjects

    nc = await nats.connect(stack.nats_url)

    async def cb(msg) -> None:
        try:
            ev = sched_decoder.decode(msg.data)
        except Exception:  # noqa: BLE001 - not ours to judge: the scheduler logs bad events
            return
        on_event(ev)

    try:
        await nc.subscribe(Subjects(stack.namespace).sched_events, cb=cb)
        await nc.flush()
        yield nc
    finally:
        await nc.close()
