"""A supervisor for a test's process stack: what compose's ``restart: unless-stopped`` does.

Services are built to exit when they cannot go on (a scheduler that lost its lease steps down and
exits, docs/scheduling.md "Fail-over") and to be started again by their supervisor. A ``Stack``
has none; a test of an outage that a service is meant to exit on runs one with this.
"""

from __future__ import annotations

import threading
import time

from libs.launcher.stack import Stack


class Supervisor:
    """Starts any process of ``stack`` that exited again (``Stack.restart``), until the ``with``
    block ends; ``restarts`` records (seconds since the start, name, exit status)."""

    def __init__(self, stack: Stack, poll_s: float = 0.2) -> None:
        self.stack = stack
        self.poll_s = poll_s
        self.restarts: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> Supervisor:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for name, proc in list(self.stack.procs.items()):
                code = proc.poll()
                if code is not None and not self._stop.is_set():
                    self.restarts.append((time.monotonic() - self._t0, name, code))
                    self.stack.restart(name)
