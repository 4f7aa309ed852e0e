"""Transient versus permanent failures in the scheduler's shell, and retrying with back-off.

A *transient* failure is one the same call may not hit later: the registry did not answer (or
answered that its store is down), Redis refused or timed out, NATS was reconnecting. The shell
retries those itself, with exponential back-off and jitter, and never lets them decide a request's
fate (nor consume the intake message's delivery budget: ``docs/scheduling.md``, "No request
lost"). Anything else is *permanent*: retrying cannot help, so the request gets a failed result.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.exceptions as redis_errors
from nats import errors as nats_errors

from libs.errors import is_retryable

T = TypeVar("T")
log = logging.getLogger(__name__)

_TRANSIENT: tuple[type[BaseException], ...] = (
    # Redis: unreachable, timing out, loading its dataset, failing over.
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.ReadOnlyError,
    redis_errors.TryAgainError,
    redis_errors.MasterDownError,
    # NATS: no responder, no answer in time, (re)connecting.
    nats_errors.NoRespondersError,
    nats_errors.TimeoutError,
    nats_errors.ConnectionReconnectingError,
    nats_errors.ConnectionClosedError,
    nats_errors.NoServersError,
    nats_errors.StaleConnectionError,
    nats_errors.FlushTimeoutError,
    nats_errors.OutboundBufferLimitError,
    # The standard library's (a socket refused or reset, asyncio.wait_for timing out).
    TimeoutError,
    ConnectionError,
)


def is_transient(exc: BaseException) -> bool:
    """Whether the same call may succeed later (``RegistryUnavailable`` is a ``RetryableError``)."""
    return is_retryable(exc) or isinstance(exc, _TRANSIENT)


class Backoff:
    """Exponential back-off with jitter: ``initial_s``, doubling up to ``max_s``, each ±``jitter``."""

    def __init__(self, initial_s: float, max_s: float, jitter: float = 0.2) -> None:
        self.initial_s = initial_s
        self.max_s = max(max_s, initial_s)
        self.jitter = jitter
        self.tries = 0

    def next(self) -> float:
        base = min(self.max_s, self.initial_s * 2.0 ** min(self.tries, 30))
        self.tries += 1
        return base * (1.0 + self.jitter * (2.0 * random.random() - 1.0))


async def retry_transient(
    op: Callable[[], Awaitable[T]],
    what: str,
    *,
    backoff: Backoff,
    give_up_after_s: float | None = None,
) -> T:
    """``op()``, retried while it fails transiently; a permanent failure, or a transient one after
    ``give_up_after_s``, is raised. Logs the first failure and every tenth."""
    start = time.monotonic()
    while True:
        try:
            return await op()
        except Exception as e:
            if not is_transient(e):
                raise
            waited = time.monotonic() - start
            if give_up_after_s is not None and waited >= give_up_after_s:
                raise
            if backoff.tries % 10 == 0:
                log.warning("%s: %s: %s; retrying (try %d)", what, type(e).__name__, e, backoff.tries + 1)
            await asyncio.sleep(backoff.next())
