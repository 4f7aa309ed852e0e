"""Read-only views of the scheduler core's state: the operator's per-tenant view and the log's counts."""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.accounting import Accounts
from services.scheduler.executors import ExecutorState
from services.scheduler.records import RequestRun


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
