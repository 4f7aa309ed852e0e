"""Running a service until SIGINT/SIGTERM, or until one of its long-lived tasks dies.

CONVENTIONS.md: inside a loop tick, log and carry on; at service level, fail fast — if a
long-lived task dies, shut down cleanly and exit non-zero so the supervisor restarts the service.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable


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
        await asyncio.gather(waiter, *running, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
