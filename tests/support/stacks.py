"""Running a process stack in a test: started, and afterwards stopped and its Redis keys dropped."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from libs.launcher.stack import Stack
from libs.protocol.keys import Keys
from tests.conftest import free_port


def drop_keys(redis_url: str, namespace: str) -> None:
    """Delete every Redis key of ``namespace`` (a test run's data)."""
    r = redis.Redis.from_url(redis_url)
    try:
        keys = list(r.scan_iter(match=Keys(namespace).pattern(), count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


def sim_stack(tmp_path: Path, **settings: object) -> Stack:
    """A stack of its own namespace and gateway port whose executors are simulated (two, at real
    speed, unless ``settings`` say otherwise), logging under ``tmp_path``."""
    defaults: dict[str, object] = {
        "namespace": "t" + uuid.uuid4().hex[:10],
        "log_dir": tmp_path / "logs",
        "model_root": tmp_path,
        "gateway_port": free_port(),
        "executors": 0,
        "sim_executors": 2,
        "sim_time_scale": 1.0,
    }
    return Stack(**(defaults | settings))  # type: ignore[arg-type]


@contextmanager
def started(stack: Stack, timeout: float = 60) -> Iterator[Stack]:
    stack.start(timeout=timeout)
    try:
        yield stack
    finally:
        stack.stop()
        if not stack.private_redis:  # a private redis-server took its data with it
            drop_keys(stack.redis_url, stack.namespace)
