"""Deployment modes: ServerlessT2I's per-node dispatch, or the paper's baselines (§8.1), through the
same gateway, scheduler and executors (docs/scheduling.md, "Deployment modes (baselines)").

* ``ours`` (default) — every node is placed on its own by the policy (best fit: model residency,
  input locality), executors cache layer prefixes.
* ``nocache``, ``wcache``, ``mcache`` — each request is one *monolithic GPU function*: its first
  node placed binds the request to one executor, which then runs all of its nodes and nothing else
  until the request ends (exclusive). The executors cache at the mode's granularity
  (``T2I_EXECUTOR_CACHE_MODE``, derived from the same ``T2I_SCHEDULER_DEPLOYMENT``): nothing kept
  after a request (NoCache), whole workflows LRU (WCache), whole models LRU shared across workflows
  (MCache). A request is bound, among the executors holding no request, to

  - NoCache: the least loaded one;
  - WCache: one with its workflow cached (every model of it on the device), else the one with the
    fewest model bytes cached (the least to evict), then the least loaded;
  - MCache: the one with the most of the request's model bytes on the device, then the fewest bytes
    cached, then the least loaded.

The policy still decides the *order* (fair, fifo, sjf, vtc, with their vTime charges and lifts):
it sees one ready node per unbound request (its first in topological order) and the free executors,
and each request it picks is bound as above; a bound request's next node goes to its executor
whenever that one is idle (the most critical ready node first). Pure bookkeeping, no I/O: the core
calls :meth:`Deployment.decide` instead of the policy, :meth:`Deployment.dispatched` for each
dispatch and :meth:`Deployment.heard` for each heartbeat (model sizes for MCache's affinity).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from libs.protocol.ids import ModelKey
from libs.protocol.messages import ExecutorHeartbeat
from services.scheduler.core.executors import ExecutorState, cached_fraction
from services.scheduler.core.policy import Policy
from services.scheduler.core.records import RequestRun
from services.scheduler.core.snapshot import (
    Assignment,
    Decision,
    ExecutorInfo,
    ReadyNode,
    Snapshot,
    TenantView,
    charge_for,
)

OURS = "ours"
NOCACHE = "nocache"
WCACHE = "wcache"
MCACHE = "mcache"
MODES = (OURS, NOCACHE, WCACHE, MCACHE)


class Deployment:
    """Which executor each request's nodes may run on, under one deployment mode."""

    def __init__(self, mode: str = OURS) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown deployment mode {mode!r}; choose one of {list(MODES)}")
        self.mode = mode
        self.monolithic = mode != OURS
        self.bound: dict[str, str] = {}  # request id -> the executor it holds
        self.holder: dict[str, str] = {}  # executor id -> the request holding it
        self.model_bytes: dict[ModelKey, int] = {}  # as executors report them (``cached``)
        self._needs: dict[str, tuple[frozenset[ModelKey], frozenset[str]]] = {}  # request: models, fns

    # -- hooks of the core --------------------------------------------------------------------------
    def heard(self, hb: ExecutorHeartbeat) -> None:
        """A heartbeat: learn the sizes of the models it caches (MCache and WCache rank by bytes)."""
        if not self.monolithic:
            return
        for raw, value in hb.cached.items():
            if cached_fraction(value) is None:
                continue  # malformed: the core logs it
            try:
                key = ModelKey.decode(raw)
            except ValueError:
                continue
            self.model_bytes[key] = value[3]

    def dispatched(self, request_id: str, executor_id: str) -> None:
        """A node of ``request_id`` went to ``executor_id``: the request holds it (monolithic)."""
        if self.monolithic and request_id not in self.bound:
            self.bound[request_id] = executor_id
            self.holder[executor_id] = request_id

    def sync(self, runs: Mapping[str, RequestRun], executors: Mapping[str, ExecutorState]) -> None:
        """Free the executors of requests that ended, and requests whose executor was lost (their
        lost work re-runs on the executor they are bound to next)."""
        for rid, ex in list(self.bound.items()):
            if rid not in runs or ex not in executors:
                del self.bound[rid]
                if self.holder.get(ex) == rid:
                    del self.holder[ex]
        for rid in [r for r in self._needs if r not in runs]:
            del self._needs[rid]

    def decide(
        self,
        policy: Policy,
        snap: Snapshot,
        runs: Mapping[str, RequestRun],
        executors: Mapping[str, ExecutorState],
    ) -> Decision:
        """The policy's decision for ``snap``, with placement as the mode says."""
        if not self.monolithic:
            return policy(snap)
        self.sync(runs, executors)
        # The lifts of tenants that (re)joined, over all their ready work (no executor offered).
        base = policy(replace(snap, idle=()))
        idle = {e.id: e for e in snap.idle}
        by_request: dict[str, list[ReadyNode]] = {}
        for n in snap.ready:
            by_request.setdefault(n.request_id, []).append(n)
        out: list[Assignment] = []
        # Requests that hold an executor: their most critical ready node, when it is idle.
        for rid, nodes in by_request.items():
            ex = idle.pop(self.bound.get(rid, ""), None)
            if ex is None:
                continue
            node = min(nodes, key=lambda n: (-n.remaining_s, n.order))
            if node.fn in ex.fns:
                out.append(Assignment(node.ref, ex.id, charge_for(node, ex)))
        free = {i: e for i, e in idle.items() if i not in self.holder}
        heads = tuple(
            min(nodes, key=lambda n: n.order) for rid, nodes in by_request.items() if rid not in self.bound
        )
        if not free or not heads:
            return Decision(out, base.lifts, base.op_lifts)
        # The others: the policy orders them (one node per request), each bound as the mode says.
        inner = policy(replace(snap, ready=heads, idle=tuple(free.values()), tenants=_lifted(snap, base)))
        node_of = {n.ref: n for n in heads}
        for a in inner.assignments:
            node = node_of.get(a.node)
            if node is None or not free:
                continue
            ex = self.choose(node, list(free.values()), runs.get(node.request_id))
            if ex is None:
                continue
            del free[ex.id]
            out.append(Assignment(node.ref, ex.id, charge_for(node, ex)))
        return Decision(out, base.lifts, base.op_lifts)

    # -- affinity ---------------------------------------------------------------------------------
    def choose(
        self, node: ReadyNode, candidates: list[ExecutorInfo], run: RequestRun | None
    ) -> ExecutorInfo | None:
        """The executor to bind ``node``'s request to, among ``candidates`` (idle, holding none)."""
        models, fns = self._needs_of(run, node)
        fits = [e for e in candidates if fns <= e.fns]
        if not fits:
            return None
        if self.mode == NOCACHE:
            return min(fits, key=lambda e: (e.load, e.id))
        if self.mode == WCACHE:
            return min(
                fits,
                key=lambda e: (
                    not all(e.fraction(m) >= 1.0 for m in models),
                    self._cached_bytes(e),
                    e.load,
                    e.id,
                ),
            )
        return min(fits, key=lambda e: (-self._bytes_of(e, models), self._cached_bytes(e), e.load, e.id))

    def _needs_of(
        self, run: RequestRun | None, node: ReadyNode
    ) -> tuple[frozenset[ModelKey], frozenset[str]]:
        if run is None:
            return frozenset({node.model_key}), frozenset({node.fn})
        needs = self._needs.get(run.request_id)
        if needs is None:
            nodes = run.dag.nodes.values()
            needs = (frozenset(ModelKey(n.fn, n.model) for n in nodes), frozenset(n.fn for n in nodes))
            self._needs[run.request_id] = needs
        return needs

    def _bytes_of(self, ex: ExecutorInfo, models: frozenset[ModelKey]) -> float:
        """Bytes of ``models`` on ``ex``'s device (by the sizes heartbeats reported)."""
        return sum(ex.fraction(m) * self.model_bytes.get(m, 0) for m in models)

    def _cached_bytes(self, ex: ExecutorInfo) -> float:
        return sum(f * self.model_bytes.get(m, 0) for m, f in ex.cached.items())


def _lifted(snap: Snapshot, base: Decision) -> dict[str, TenantView]:
    """The tenants' views with ``base``'s lifts applied (the second policy call must not lift again)."""
    out = dict(snap.tenants)
    for name, view in snap.tenants.items():
        if name in base.lifts or name in base.op_lifts:
            out[name] = replace(
                view,
                vtime=base.lifts.get(name, view.vtime),
                ops=base.op_lifts.get(name, view.ops),
                returning=False,
                rejoining=False,
            )
    return out
