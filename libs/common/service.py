"""One shape for every service: ``start`` → ``run`` → ``stop``, driven by one helper.

A service object owns its subscriptions and background tasks; its ``__main__`` only wires config,
connections and the object together and hands a builder to :func:`main`::

    async def build(stack: AsyncExitStack) -> Service:
        nc = await connect(url, "registry")
        own(stack, nc.drain, "nats")                 # closed after the service has stopped
        return RegistryService(nc, ...)

    if __name__ == "__main__":
        main(build)

:func:`serve` starts the service, runs it until SIGINT/SIGTERM or until ``run()`` ends (a service's
``run`` only returns or raises when something long-lived died: the process then exits non-zero so
its supervisor restarts it), then stops it and closes what the builder registered, in reverse
order, each step bounded in time so a stuck close cannot hang the exit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Protocol

from libs.common.runner import cancel_and_wait, close_quietly, run_service

__all__ = ["Service", "main", "own", "run_all", "run_forever", "serve"]


class Service(Protocol):
    async def start(self) -> None:
        """Subscribe, bind, spawn background work; return once the service is serving."""

    async def run(self) -> None:
        """Await the service's long-lived work. Returning or raising means it died."""

    async def stop(self) -> None:
        """Undo ``start``; safe to call twice and after a failed ``start``."""


async def run_forever() -> None:
    """``run`` of a service whose work is all in callbacks (subscriptions, HTTP handlers)."""
    await asyncio.Event().wait()


async def run_all(*loops: Awaitable[None]) -> None:
    """``run`` of a service with several long-lived loops: they run together, and the first to end
    (return or raise) ends them all; its error, or a ``RuntimeError`` saying it returned, propagates."""
    tasks = [asyncio.ensure_future(loop) for loop in loops]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()  # re-raises the loop's error
        raise RuntimeError(f"a long-lived loop returned: {next(iter(done)).get_coro()!r}")
    finally:
        await cancel_and_wait(tasks)  # again and again where a library swallowed the cancel


def own(stack: AsyncExitStack, close: Callable[[], Awaitable[object]], what: str) -> None:
    """Register ``close()`` (``nc.drain``, ``redis.aclose``) to run, time-bounded, when ``stack`` unwinds."""

    async def _close() -> None:
        await close_quietly(close(), what)

    stack.push_async_callback(_close)


async def serve(build: Callable[[AsyncExitStack], Awaitable[Service]]) -> None:
    """Build, start, run until a stop signal or a death, then stop and close everything."""
    async with AsyncExitStack() as stack:
        service = await build(stack)
        own(stack, service.stop, type(service).__name__)
        await service.start()
        await run_service(service.run())


def main(build: Callable[[AsyncExitStack], Awaitable[Service]]) -> None:
    """The body of every ``python -m services.<name>``."""
    asyncio.run(serve(build))
