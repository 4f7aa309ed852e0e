"""Running a service until SIGINT/SIGTERM, or until one of its long-lived tasks dies.

Two failure boundaries (docs/conventions.md): inside a loop tick, log and carry on; at service level, fail fast — if a
long-lived task dies, shut down cleanly and exit non-zero so the supervisor restarts the service.
"""

from __future__ import annotations

import asyncio
import io
import logging
import signal
from collections.abc import Awaitable, Iterable
from typing import Any

log = logging.getLogger(__name__)
STOP_GRACE_S = 5.0


async def run_service(*tasks: Awaitable[None]) -> None:
    """Wait for a stop signal; any task that ends (or raises) stops the service with its error."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running = [asyncio.ensure_future(t) for t in tasks]
    waiter = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([waiter, *running], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not waiter:
                exc = t.exception()
                raise RuntimeError(f"a service task ended unexpectedly: {exc!r}") from exc
    finally:
        for t in [waiter, *running]:
            t.cancel()
        _, stuck = await asyncio.wait([waiter, *running], timeout=STOP_GRACE_S)
        for t in stuck:  # a task that ignores cancellation must not keep the process alive
            buf = io.StringIO()
            t.print_stack(file=buf)
            log.error("task did not stop within %.0fs:\n%s", STOP_GRACE_S, buf.getvalue())
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], every_s: float = 0.5) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again every ``every_s`` any that is
    still running: a task whose ``CancelledError`` a library swallowed (nats-py catches it in its
    flush and in a pull subscription's fetch) goes on as if it had never been cancelled, and one
    cancel would leave the waiter waiting for ever. A cancel of the caller meanwhile is kept and
    raised once the tasks have ended. Their errors are retrieved, not raised."""
    pending = {t for t in tasks if not t.done()}
    cancelled = False
    while pending:
        for t in pending:
            t.cancel()
        try:
            _, pending = await asyncio.wait(pending, timeout=every_s)
        except asyncio.CancelledError:
            cancelled = True
        if pending:
            log.debug("%d task(s) still running after a cancel; cancelling again", len(pending))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: no "exception was never retrieved" at garbage collection
    if cancelled:
        raise asyncio.CancelledError


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if the current task was cancelled and the error was swallowed.

    nats-py catches ``CancelledError`` in some of its calls (its pending-data flush, which
    ``subscribe`` and ``publish`` go through), so a cancel that arrives during one is lost: the call
    returns normally and the task goes on as if never cancelled, though ``Task.cancelling()`` still
    counts the request. A task that must stop when cancelled (a service being shut down) calls this
    after a run of such calls.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def close_quietly(aw: Awaitable[object], what: str, grace_s: float | None = None) -> None:
    """Await a shutdown step (``nc.drain()``, ``redis.aclose()``) without letting it hang the exit."""
    try:
        await asyncio.wait_for(aw, STOP_GRACE_S if grace_s is None else grace_s)
    except Exception as e:  # noqa: BLE001 - at exit, a failed close is only worth a line
        log.warning("closing %s: %s", what, e or type(e).__name__)
