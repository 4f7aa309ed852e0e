"""A request's deadline: ``submitted_at`` (unix seconds, set by the gateway) + ``timeout_s``.

Pure: the shell passes the wall clock (``time.time()``) and the monotonic clock it schedules by, and
gets the deadline on the monotonic clock, so time a request spent in the intake (backpressure, a
registry outage, a scheduler restart) counts against it, and a request that is already past it
when it is taken in is answered with ``timeout`` at once, without running anything.

Clock skew between the gateway and the scheduler is tolerated up to a bound: a ``submitted_at``
more than :data:`MAX_FUTURE_S` in the future, or older than :data:`MAX_AGE_S` (the intake keeps a
message an hour), is taken to be a broken clock rather than a fact; the deadline then counts from
the moment the scheduler takes the request in (what it did before it read ``submitted_at``), and
``skew`` says why, for the log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from libs.protocol.messages import ImageRequest

MAX_FUTURE_S = 60.0  # a submission time further ahead than this is the gateway's clock, not a fact
MAX_AGE_S = 86400.0  # nor is one older than a day (the intake drops messages after an hour)


@dataclass(frozen=True)
class Deadline:
    at: float  # the deadline, on the monotonic clock ``now`` was read from
    submitted_at: float  # the submission time used (unix seconds), after clamping
    skew: str = ""  # why ``submitted_at`` was not used as sent ("" when it was)

    def passed(self, now: float) -> bool:
        return now >= self.at


def deadline_of(req: ImageRequest, *, wall: float, now: float) -> Deadline:
    """The deadline of ``req`` taken in at ``wall`` (unix seconds) = ``now`` (monotonic seconds)."""
    sub = req.submitted_at
    skew = ""
    if not math.isfinite(sub) or sub > wall + MAX_FUTURE_S:
        skew = f"submitted_at {sub!r} is {sub - wall:.0f}s ahead of this scheduler's clock"
    elif sub < wall - MAX_AGE_S:
        skew = f"submitted_at {sub!r} is {wall - sub:.0f}s old, more than {MAX_AGE_S:.0f}s"
    if skew:
        sub = wall
    timeout = req.timeout_s if math.isfinite(req.timeout_s) else 0.0
    return Deadline(at=now + (sub + timeout - wall), submitted_at=sub, skew=skew)
