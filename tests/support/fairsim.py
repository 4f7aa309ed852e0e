"""A discrete-event simulation that drives the real scheduler core, for fairness properties.

Executors are simulated as completions ``cost`` seconds after a dispatch. Each tenant's requests
are chains of nodes whose cost depends on the ModelFn (``fn`` = tenant + position), and the
estimator is seeded with the exact costs, so charges equal measurements (the setting of the
paper's bound). After every event the simulation records each tenant's vTime and whether it is
*eligible-backlogged* (has a ready node waiting, paper §6).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from libs.protocol.messages import ExecutorHeartbeat, ImageRef, ImageRequest, NodeComplete, NodeTiming
from libs.protocol.tensor_meta import TensorMeta
from libs.workflow.dag import Dag, DagNode, TensorSource
from services.scheduler.core.effects import ChargeVTime, SendDispatch
from services.scheduler.core.estimates import Estimator
from services.scheduler.core.policy import Policy
from services.scheduler.core.scheduling import SchedulerCore


@dataclass(frozen=True)
class Arrival:
    at: float
    tenant: str
    costs: tuple[float, ...]  # one per node of the chain


@dataclass
class Sample:
    t: float
    vtime: dict[str, float]
    service: dict[str, float]
    eligible: dict[str, bool]  # has a ready node waiting, and has been settled (lifted if due)


@dataclass
class Trace:
    samples: list[Sample] = field(default_factory=list)
    max_charge: float = 0.0


def chain_dag(tenant: str, costs: tuple[float, ...]) -> Dag:
    nodes, consumers, successors = {}, {}, {}
    for i in range(len(costs)):
        nid = f"n{i}"
        deps = frozenset({f"n{i - 1}"}) if i else frozenset()
        inputs = {"x": TensorSource(f"n{i - 1}", "y")} if i else {}
        nodes[nid] = DagNode(nid, f"{tenant}.{i}", "m", inputs, frozenset(), ("y",), deps, i)
        successors[nid] = [f"n{i + 1}"] if i < len(costs) - 1 else []
        if i:
            consumers[TensorSource(f"n{i - 1}", "y")] = 1
    return Dag(nodes, {"image": TensorSource(f"n{len(costs) - 1}", "y")}, consumers, successors)


def simulate(policy: Policy, arrivals: list[Arrival], executors: int) -> Trace:
    # Exact estimates: each (tenant, position) ModelFn always costs the same.
    costs: dict[str, float] = {}
    for a in arrivals:
        for i, c in enumerate(a.costs):
            costs.setdefault(f"{a.tenant}.{i}", c)
    core = SchedulerCore(policy, estimator=Estimator(defaults=costs), heartbeat_timeout_s=1e12)
    fns = sorted(costs)
    for e in range(executors):
        core.on_heartbeat(ExecutorHeartbeat(f"e{e}", "sim", "shm", "s", fns), 0.0)
    events: list[tuple[float, int, object]] = []
    seq = 0
    for i, a in enumerate(arrivals):
        events.append((a.at, seq, ("arrive", i, a)))
        seq += 1
    heapq.heapify(events)
    trace = Trace()
    tenants = sorted({a.tenant for a in arrivals})
    while events:
        now = events[0][0]
        while events and events[0][0] == now:  # everything that happens at this instant, then schedule
            _, _, ev = heapq.heappop(events)
            kind = ev[0]
            if kind == "arrive":
                _, i, a = ev
                core.add_request(
                    ImageRequest(f"r{i}", a.tenant, "w", 1, {}, 0.0, timeout_s=1e12),
                    chain_dag(a.tenant, a.costs),
                    attempt=1,
                    now=now,
                )
            else:
                core.on_complete(ev[1], now)
        # Sample the state before the round and after every change within it: an interval ends at
        # the dispatch that takes a tenant's last waiting node, not at the end of the round.
        accts = core.accounts
        waiting = {t: 0 for t in tenants}
        for run in core.runs.values():
            waiting[run.req.tenant] += len(run.nodes.ready)
        vt = {t: accts[t].vtime for t in tenants}
        # A tenant that arrives, returns or rejoins becomes eligible when this round's lift applies.
        joining = {t: accts[t].returning or not accts[t].waiting for t in tenants}

        trace.samples.append(_sample(now, vt, core, waiting, joining))
        effects = core.schedule(now)
        # A round's lifts come first; joiners count as eligible once all of them are applied.
        lifts = [e for e in effects if isinstance(e, ChargeVTime) and e.set_vtime is not None]
        for eff in lifts:
            vt[eff.tenant] = eff.set_vtime
        joining = {t: False for t in tenants}
        trace.samples.append(_sample(now, vt, core, waiting, joining))
        for eff in effects:
            if isinstance(eff, ChargeVTime) and eff.set_vtime is None:
                vt[eff.tenant] += eff.delta
                trace.samples.append(_sample(now, vt, core, waiting, joining))
            elif isinstance(eff, SendDispatch):
                m = eff.msg
                waiting[m.tenant] -= 1
                cost = costs[m.fn]
                trace.max_charge = max(trace.max_charge, cost)
                outs = {
                    o.name: TensorMeta(
                        m.ref.output(o.name).encode(), eff.executor, "shm", "s", 0, 4, "float32", [1]
                    )
                    for o in m.outputs
                    if o.consumers
                }
                sinks = {o.name: ImageRef("b", o.sink, 1, 1, 1) for o in m.outputs if o.sink}
                done = NodeComplete(
                    eff.executor, m.request_id, m.attempt, m.node_id, outs, sinks, NodeTiming(exec_s=cost)
                )
                heapq.heappush(events, (now + cost, seq, ("done", done)))
                seq += 1
        assert vt == {t: accts[t].vtime for t in tenants}  # the replay matches the core's accounts
    return trace


def _sample(
    now: float, vt: dict[str, float], core: SchedulerCore, waiting: dict[str, int], joining: dict[str, bool]
) -> Sample:
    return Sample(
        t=now,
        vtime=dict(vt),
        service={t: core.accounts[t].service_s for t in vt},
        eligible={t: waiting[t] > 0 and not joining[t] for t in vt},
    )


def windows(trace: Trace, f: str, g: str) -> list[list[Sample]]:
    """Maximal runs of consecutive samples during which both tenants are eligible-backlogged.

    A run includes the sample that ends it: the state right after the dispatch that took one of
    them out of eligibility is ``v(t2)`` for the interval ``[t1, t2)``.
    """
    out, cur = [], []
    for s in trace.samples:
        if s.eligible[f] and s.eligible[g]:
            cur.append(s)
        elif cur:
            cur.append(s)
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def max_service_gap(window: list[Sample], f: str, g: str) -> float:
    """max over t1 < t2 in the window of |W_f(t1,t2) - W_g(t1,t2)| (vTime received)."""
    d = [s.vtime[f] - s.vtime[g] for s in window]
    return max(d) - min(d)
