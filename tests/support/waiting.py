"""How tests wait: for a condition (``until``), never for a guessed length of time.

A fixed sleep that "proves" something did not happen passes on a fast machine and fails — or,
worse, passes wrongly — on a loaded one. Tests here wait on the event itself (a condition that
comes true, a message that arrives), and prove absence with a *handshake*: after the thing that
must have no effect, send a marker down the same ordered path (the same NATS connection and
subscription, the same Redis connection, the same HTTP client) and wait until the marker's effect
is seen; whatever came before it on that path has been handled by then, so its absence of effect
is real.

The only other waiting is :func:`elapse`: where the passing of time *is* the behaviour under test
(an outage that lasts a while, a TTL that runs out, a quota window that begins), with the reason
spelled out. ``grep -rn "sleep(" tests/`` finds nothing outside this module and the fakes that
simulate work.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

__all__ = ["elapse", "elapse_sync", "until", "until_sync"]


async def until(cond: Callable[[], object], within_s: float = 10.0, step: float = 0.02) -> bool:
    """Whether ``cond()`` (a function, or one returning an awaitable) came true within ``within_s``
    seconds, checked every ``step``. Callers assert on it, with a message saying what was awaited."""
    deadline = time.monotonic() + within_s
    while True:
        v = cond()
        if await v if inspect.isawaitable(v) else v:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(step)


def until_sync(cond: Callable[[], object], within_s: float = 10.0, step: float = 0.02) -> bool:
    """:func:`until` for tests that drive processes synchronously."""
    deadline = time.monotonic() + within_s
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


async def elapse(seconds: float, *, because: str) -> None:
    """Let ``seconds`` pass where time itself is what the test is about (``because`` says how)."""
    assert because, "say why time itself must pass"
    await asyncio.sleep(seconds)


def elapse_sync(seconds: float, *, because: str) -> None:
    """:func:`elapse` for synchronous tests."""
    assert because, "say why time itself must pass"
    time.sleep(seconds)
