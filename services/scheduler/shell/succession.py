"""A scheduler process that is never without a scheduler: one reign after another.

A reign is one :class:`SchedulerService` with connections of its own: it waits as a standby until
it holds the lease, leads, and ends when it steps down (``run`` raises :class:`LeaseLost`: the lease
was lost, or it was told its epoch is stale). Then it is stopped and closed, and a fresh one is
built — new connections, an empty core, since what the old one knew may be stale — which waits as
a standby again. So a process that steps down is a standby at once, and "no leader" lasts at most a
lease TTL and a poll, with or without a supervisor (``make run`` has none). ``__main__`` runs one
:class:`Succession`; the tests run theirs the same way, several in one event loop.

Any other end of a reign (a loop that died, a build that failed) ends the succession with its
error: the process exits non-zero for its supervisor, as every service does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

from libs.common.runner import raise_if_cancelled
from libs.common.service import own
from services.scheduler.shell.lease import LeaseLost
from services.scheduler.shell.service import SchedulerService

log = logging.getLogger(__name__)

Build = Callable[[AsyncExitStack], Awaitable[SchedulerService]]


class Succession:
    """Reigns of one scheduler process, each built by ``build(stack)`` (which registers on
    ``stack`` what closes its connections), until cancelled (a stop: the current reign is stopped
    cleanly, handing the lease over if it holds it)."""

    def __init__(self, build: Build) -> None:
        self.build = build
        self.current: SchedulerService | None = None
        self.stepped_down: list[tuple[int, str]] = []  # (epoch, why) of each reign that stepped down
        self.reigns = 0  # services built so far
        self._started: SchedulerService | None = None  # the current reign, once start() returned

    @property
    def leading(self) -> bool:
        """Whether the current reign leads and is serving (its intake bound, its events subscribed)."""
        svc = self.current
        return svc is not None and svc is self._started and svc.leading

    async def run(self) -> None:
        while True:
            async with AsyncExitStack() as stack:
                svc = await self.build(stack)
                own(stack, svc.stop, "scheduler")
                self.current = svc
                self.reigns += 1
                raise_if_cancelled()  # a stop that nats-py swallowed while connecting
                await svc.start()
                raise_if_cancelled()  # ... or while subscribing: it must not serve for ever
                self._started = svc
                try:
                    await svc.run()
                except LeaseLost as e:
                    self.stepped_down.append((svc.epoch, str(e)))
                    log.warning("stepped down (epoch %d: %s)", svc.epoch, e)
            await asyncio.sleep(0)  # the old reign is closed; the next starts as a standby
