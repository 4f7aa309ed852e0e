"""The one service lifecycle (libs/common/service.py): start, run until a signal or a death, stop,
then close what the builder registered, in reverse order."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import AsyncExitStack

import pytest

from libs.common.service import own, run_forever, serve


class Recorder:
    def __init__(
        self,
        events: list[str],
        run: object = None,
        fail_start: bool = False,
        running: asyncio.Event | None = None,
    ) -> None:
        self.events = events
        self._run = run
        self.fail_start = fail_start
        self.running = running or asyncio.Event()

    async def start(self) -> None:
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("cannot bind")

    async def run(self) -> None:
        self.events.append("run")
        self.running.set()
        if self._run is None:
            await run_forever()
        else:
            await self._run()

    async def stop(self) -> None:
        self.events.append("stop")


def builder(events: list[str], **kw: object):
    async def build(stack: AsyncExitStack) -> Recorder:
        async def close_connection() -> None:
            events.append("close connection")

        own(stack, close_connection, "connection")
        return Recorder(events, **kw)

    return build


async def test_a_signal_stops_the_service_and_then_closes_its_connections():
    events: list[str] = []
    running = asyncio.Event()
    task = asyncio.create_task(serve(builder(events, running=running)))
    await asyncio.wait_for(running.wait(), 10)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 10)
    assert events == ["start", "run", "stop", "close connection"]


async def test_a_service_whose_run_dies_stops_cleanly_and_reports_the_error():
    events: list[str] = []

    async def dies() -> None:
        raise ConnectionError("lost the bus")

    with pytest.raises(RuntimeError, match="lost the bus"):
        await asyncio.wait_for(serve(builder(events, run=dies)), 10)
    assert events == ["start", "run", "stop", "close connection"]


async def test_a_failed_start_still_stops_the_service_and_closes_its_connections():
    events: list[str] = []
    with pytest.raises(RuntimeError, match="cannot bind"):
        await asyncio.wait_for(serve(builder(events, fail_start=True)), 10)
    assert events == ["start", "stop", "close connection"]


async def test_a_close_that_hangs_does_not_hang_the_exit(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("libs.common.runner.STOP_GRACE_S", 0.2)
    events: list[str] = []

    async def build(stack: AsyncExitStack) -> Recorder:
        async def hangs() -> None:
            await asyncio.Event().wait()

        own(stack, hangs, "stuck connection")
        return Recorder(events, run=lambda: asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="ended unexpectedly"):
        await asyncio.wait_for(serve(build), 10)
    assert events == ["start", "run", "stop"]
