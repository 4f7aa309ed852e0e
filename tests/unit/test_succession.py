"""A scheduler process's reigns (services/scheduler/shell/succession.py), with fake services built by
the injected ``build``: a reign that steps down is stopped and followed by a fresh one, and a stop
(a cancel) ends the succession even when the library code it interrupts swallows the cancel."""

from __future__ import annotations

import asyncio

from services.scheduler.shell.lease import LeaseLost
from services.scheduler.shell.succession import Succession
from tests.support.waiting import until


class FakeReign:
    """Stands in for a SchedulerService: ``start`` and ``run`` as scripted, ``stop`` recorded."""

    def __init__(self, n: int, *, steps_down: bool = False, swallows_cancel: bool = False) -> None:
        self.n = n
        self.epoch = n
        self.leading = False
        self.steps_down = steps_down
        self.swallows_cancel = swallows_cancel
        self.starting = asyncio.Event()
        self.stopped = False

    async def start(self) -> None:
        self.starting.set()
        if self.swallows_cancel:
            try:  # what nats-py's flush does with a CancelledError
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                pass
        self.leading = True

    async def run(self) -> None:
        if self.steps_down:
            self.leading = False
            raise LeaseLost("the lease is no longer ours")
        await asyncio.Event().wait()

    async def stop(self) -> None:
        self.stopped = True


def builder(*reigns: FakeReign):
    made: list[FakeReign] = []

    async def build(stack) -> FakeReign:
        reign = reigns[len(made)]
        made.append(reign)
        return reign

    return build, made


async def test_a_reign_that_steps_down_is_stopped_and_a_fresh_one_serves():
    first, second = FakeReign(1, steps_down=True), FakeReign(2)
    build, made = builder(first, second)
    succession = Succession(build)  # type: ignore[arg-type]
    task = asyncio.create_task(succession.run())
    try:
        assert await until(lambda: succession.leading and succession.current is second), made
        assert first.stopped and not second.stopped and succession.reigns == 2
        assert succession.stepped_down == [(1, "the lease is no longer ours")]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert second.stopped  # a stop stops the current reign


async def test_a_cancel_swallowed_while_a_reign_starts_still_ends_the_succession():
    reign = FakeReign(1, swallows_cancel=True)
    build, _ = builder(reign)
    task = asyncio.create_task(Succession(build).run())  # type: ignore[arg-type]
    await reign.starting.wait()
    task.cancel()  # arrives inside start(), which swallows it
    done, _ = await asyncio.wait([task], timeout=30.0)
    assert done, "the succession went on serving after it was cancelled"
    assert task.cancelled() and reign.stopped


async def test_a_step_down_ends_the_reign_even_when_a_loop_swallows_the_cancel_that_stops_it():
    """``run_all`` (every service's long-lived loops): when one loop ends, the others are cancelled
    again until they have ended, so a loop whose library call swallowed the first cancel (nats-py's
    pull fetch, its flush) cannot keep a stepped-down reign from ending. Found in a full suite: the
    stale-epoch test's leader logged its step-down and never got to the next reign."""
    from libs.common.service import run_all

    swallowed = 0

    async def fetching_for_ever() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                swallowed += 1  # what the library does: the loop goes on as if never cancelled
                if swallowed == 3:
                    raise

    async def lease_lost() -> None:
        await asyncio.sleep(0)
        raise LeaseLost("told the epoch is stale")

    try:
        await asyncio.wait_for(run_all(fetching_for_ever(), lease_lost()), 30.0)
    except LeaseLost:
        pass
    assert swallowed == 3
