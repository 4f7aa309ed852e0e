"""The event-loop watchdog (libs/common/watchdog.py): a stall is observed, and reported with the
stack of the code blocking the loop, caught while it blocks."""

from __future__ import annotations

import asyncio
import logging

from libs.common.watchdog import LoopWatchdog
from tests.support.waiting import until, until_sync


def _hold_the_loop_until_reported(wd: LoopWatchdog) -> None:
    """Block the loop (as a long synchronous call would) until the watchdog has reported it."""
    assert until_sync(lambda: wd.reported > 0, 30.0, step=0.005), "the stall was never reported"


async def test_a_blocked_loop_is_reported_with_the_blocking_code_and_its_lag_observed(caplog):
    lags: list[float] = []
    wd = LoopWatchdog("test", every_s=0.01, report_s=0.05, observe=lags.append)
    wd.start()
    try:
        assert await until(lambda: wd.probes >= 3), "no probe ran on a healthy loop"
        with caplog.at_level(logging.WARNING, logger="libs.common.watchdog"):
            _hold_the_loop_until_reported(wd)
            assert wd.reported == 1
            seen = wd.probes
            # The probe that waited through the stall runs now.
            assert await until(lambda: wd.probes > seen), "the waiting probe never ran"
    finally:
        wd.stop()
    blocked = [r.getMessage() for r in caplog.records if "blocked for over" in r.getMessage()]
    assert len(blocked) == 1 and "_hold_the_loop_until_reported" in blocked[0], blocked
    # A report means a probe waited longer than report_s; it is observed once it runs.
    assert wd.worst_s >= 0.05 and max(lags) == wd.worst_s
    assert any("event loop was blocked for" in r.getMessage() for r in caplog.records)


async def test_a_stopped_watchdog_sends_no_more_probes():
    wd = LoopWatchdog("test", every_s=0.01)
    wd.start()
    assert await until(lambda: wd.probes >= 2), "no probe ran"
    wd.stop()
    assert wd._thread is not None
    await asyncio.to_thread(wd._thread.join, 10.0)
    assert not wd._thread.is_alive()
