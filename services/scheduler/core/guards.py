"""The scheduler core's guards against bad input and stuck work; pure, like the rest of the core.

* :func:`timing_problem`: an executor's measured times are charged to tenants as vTime and feed the
  estimates, so a completion whose timing is not finite and >= 0 is refused (the decoder already
  refuses one off the bus; this catches one built in-process). The core then treats the node as
  lost: it runs again, and its tenant keeps the estimate it was charged, never a negative charge.
* :func:`overdue`: a dispatched node that has run longer than its time limit — ``max(base_s,
  factor × its estimate)`` — is taken off its executor: the core requeues it elsewhere and keeps
  the executor out of placement (``ExecutorState.hung``) until its heartbeats stop reporting the
  node (it finished late, gave up, or restarted).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from libs.protocol.messages import NodeTiming
from services.scheduler.core.lifecycle import NodeRecord
from services.scheduler.core.records import RequestRun

TIMING_FIELDS = ("load_s", "fetch_s", "exec_s", "store_s", "load_frac")
MAX_SECONDS = 1e6  # as ``libs.protocol.messages.Seconds``


def timing_problem(t: NodeTiming) -> str | None:
    """What is wrong with a completion's timing, or None when every field is finite and >= 0."""
    for name in TIMING_FIELDS:
        v = getattr(t, name)
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            return f"{name}={v!r} is not a finite number >= 0"
        if name != "load_frac" and v > MAX_SECONDS:
            return f"{name}={v!r} is more than {MAX_SECONDS:g}s"
    if t.load_frac > 1.0:
        return f"load_frac={t.load_frac!r} is more than 1"
    if not isinstance(t.load_bytes, int) or t.load_bytes < 0:
        return f"load_bytes={t.load_bytes!r} is not an integer >= 0"
    return None


def node_limit_s(rec: NodeRecord, base_s: float, factor: float) -> float:
    """How long ``rec`` may run: ``base_s``, or ``factor`` × its estimate when that is longer."""
    return max(base_s, factor * rec.charge_s)


@dataclass(frozen=True)
class Overdue:
    run: RequestRun
    rec: NodeRecord
    limit_s: float
    ran_s: float


def overdue(runs: Iterable[RequestRun], now: float, base_s: float, factor: float) -> list[Overdue]:
    """The in-flight nodes that have run past their limit (``base_s <= 0`` turns the check off)."""
    if base_s <= 0:
        return []
    out = []
    for run in runs:
        for rec in run.nodes.in_flight.values():
            limit = node_limit_s(rec, base_s, factor)
            if now - rec.dispatched_at > limit:
                out.append(Overdue(run, rec, limit, now - rec.dispatched_at))
    return out
