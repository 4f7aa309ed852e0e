"""How long an event loop keeps ready work waiting, watched from a thread of its own; and
:class:`TimeSlice`, for loops of work that should not keep it waiting.

asyncio runs one callback at a time: one that computes for a second (a large scheduling round, a
big decode, a synchronous call) holds up every timer, message and answer queued behind it. A
:class:`LoopWatchdog` puts a probe on the loop every ``every_s`` from its thread and times how long
the probe waited before it ran: the loop's *lag*. Each lag is handed to ``observe`` (a histogram)
and the worst is kept (``worst_s``); a probe still waiting after ``report_s`` gets the stack of the
loop's thread logged once — the code that is blocking it, caught in the act — and its lag is
logged when it finally runs. asyncio's own slow-callback report needs debug mode, which slows
every callback; this costs one cross-thread wake-up per ``every_s``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopWatchdog:
    def __init__(
        self,
        what: str,
        *,
        every_s: float = 0.05,
        report_s: float = 0.5,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        self.what = what
        self.every_s = every_s
        self.report_s = report_s
        self._observe = observe
        self.worst_s = 0.0
        self.probes = 0  # probes that ran
        self.reported = 0  # stalls longer than ``report_s``
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0

    def start(self) -> None:
        """Watch the running loop (call it from the loop's thread)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name=f"watchdog-{self.what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (safe to call twice); does not wait for the thread."""
        self._stop.set()

    def _watch(self) -> None:
        loop = self._loop
        assert loop is not None
        while not self._stop.wait(self.every_s):
            ran = threading.Event()
            try:
                loop.call_soon_threadsafe(self._probe, time.monotonic(), ran)
            except RuntimeError:  # the loop is closed
                return
            if ran.wait(self.report_s):
                continue
            self.reported += 1
            frame = sys._current_frames().get(self._loop_thread)  # noqa: SLF001 - the documented way
            where = "".join(traceback.format_stack(frame, limit=16)) if frame is not None else "?\n"
            log.warning(
                "%s: event loop blocked for over %.1f s, in:\n%s", self.what, self.report_s, where.rstrip()
            )
            while not ran.wait(self.every_s):  # one report per stall: wait for the probe to run
                if self._stop.is_set():
                    return

    def _probe(self, sent: float, ran: threading.Event) -> None:
        lag = time.monotonic() - sent
        self.probes += 1
        if lag > self.worst_s:
            self.worst_s = lag
        if self._observe is not None:
            self._observe(lag)
        if lag >= self.report_s:
            log.warning("%s: event loop was blocked for %.2f s", self.what, lag)
        ran.set()


class TimeSlice:
    """Long synchronous stretches cut into slices: ``await slice.check()`` between items of work
    yields to the event loop once ``seconds`` have passed since the last yield (and is free
    otherwise), so a batch of a thousand items holds up timers and messages for a slice, not
    for the whole batch."""

    def __init__(self, seconds: float = 0.01) -> None:
        self.seconds = seconds
        self._since = time.perf_counter()

    async def check(self) -> None:
        if time.perf_counter() - self._since >= self.seconds:
            await asyncio.sleep(0)
            self._since = time.perf_counter()
