"""Running a process stack in a test: started, and afterwards stopped and its Redis keys dropped."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from libs.launcher.stack import Stack
from libs.protocol.keys import Keys


def drop_keys(redis_url: str, namespace: str) -> None:
    """Delete every Redis key of ``namespace`` (a test run's data)."""
    r = redis.Redis.from_url(redis_url)
    try:
        keys = list(r.scan_iter(match=Keys(namespace).pattern(), count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


@contextmanager
def started(stack: Stack, timeout: float = 60) -> Iterator[Stack]:
    stack.start(timeout=timeout)
    try:
        yield stack
    finally:
        stack.stop()
        if not stack.private_redis:  # a private redis-server took its data with it
            drop_keys(stack.redis_url, stack.namespace)
