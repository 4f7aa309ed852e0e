"""Read-only views of the scheduler core's state: the operator's per-tenant and per-executor views
and the log's counts."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from services.scheduler.core.accounting import Accounts
from services.scheduler.core.executors import ExecutorState
from services.scheduler.core.records import RequestRun


def tenant_stats(accounts: Accounts, runs: Iterable[RequestRun]) -> dict[str, dict[str, float | int]]:
    """Per tenant: vTime, measured service, operations, requests in progress, and its work."""
    out: dict[str, dict[str, float | int]] = {}
    for name, a in accounts.tenants.items():
        out[name] = {
            "vtime_s": round(a.vtime, 6),
            "service_s": round(a.service_s, 6),
            "ops": a.ops,
            "requests": a.requests,
            "queued": 0,
            "ready_nodes": 0,
            "running_nodes": 0,
        }
    for run in runs:
        d = out.setdefault(run.req.tenant, {"queued": 0, "ready_nodes": 0, "running_nodes": 0})
        d["ready_nodes"] += len(run.nodes.ready)
        d["running_nodes"] += len(run.nodes.in_flight)
        if run.nodes.done == 0 and not run.nodes.in_flight:
            d["queued"] += 1
    return out


def stats(executors: Iterable[ExecutorState], runs: Iterable[RequestRun]) -> dict[str, int]:
    execs, reqs = list(executors), list(runs)
    return {
        "requests": len(reqs),
        "executors": len(execs),
        "idle_executors": sum(1 for e in execs if e.idle),
        "hung_executors": sum(1 for e in execs if e.hung is not None),
        "ready_nodes": sum(len(r.nodes.ready) for r in reqs),
        "running_nodes": sum(len(r.nodes.in_flight) for r in reqs),
    }


def live_attempts(runs: Iterable[RequestRun]) -> list[str]:
    """The attempts in progress, encoded (what ``LiveAttempts`` carries to executors)."""
    return [run.ref.encode() for run in runs]


BUSY_TIME_CONSTANT_S = 10.0  # the busy fraction is an exponential average over about this long


def running_nodes(ex: ExecutorState) -> int:
    """Nodes an executor runs as far as the scheduler knows: ours in flight there (including one
    over its time limit it still reports) and any it reports that this scheduler never sent."""
    ours = {n for n in (ex.running, ex.hung) if n is not None}
    return len(ours) + len(ex.foreign)


class BusyMeter:
    """Each executor's busy fraction in [0, 1]: an exponential average, over about
    ``BUSY_TIME_CONSTANT_S``, of whether it was running a node at each sample (the shell samples it
    every tick)."""

    def __init__(self) -> None:
        self.busy: dict[str, float] = {}
        self._at: dict[str, float] = {}

    def sample(self, executors: Mapping[str, ExecutorState], now: float) -> None:
        for ex_id, ex in executors.items():
            running = 1.0 if running_nodes(ex) else 0.0
            last = self._at.get(ex_id)
            self._at[ex_id] = now
            if last is None:
                self.busy[ex_id] = running
                continue
            w = 1.0 - math.exp(-max(0.0, now - last) / BUSY_TIME_CONSTANT_S)
            self.busy[ex_id] += (running - self.busy[ex_id]) * w
        for gone in [e for e in self.busy if e not in executors]:
            del self.busy[gone], self._at[gone]


def executors_view(
    executors: Mapping[str, ExecutorState], busy: Mapping[str, float], now: float, wall: float
) -> dict[str, dict]:
    """The operator's view of each executor (``{ns}:executors``): its kind, ModelFns, the models
    resident on its device and in its box's host tier (encoded ``fn|model`` keys), the nodes it
    runs, its busy fraction and when it was last heard from (unix time; ``now`` is monotonic)."""
    return {
        ex.id: {
            "kind": ex.kind,
            "gpu": ex.gpu,
            "fns": sorted(ex.fns),
            "resident": sorted(k.encode() for k in ex.resident),
            "host_resident": sorted(k.encode() for k in ex.host_resident),
            "running": running_nodes(ex),
            "busy": round(min(1.0, max(0.0, busy.get(ex.id, 0.0))), 4),
            "seen": round(wall - (now - ex.last_seen), 3),
        }
        for ex in executors.values()
    }
