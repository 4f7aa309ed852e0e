"""What a scheduling policy sees: an immutable snapshot of ready nodes and idle executors.

Policies are pure functions ``policy(snapshot) -> Decision`` (Ray Serve's autoscaling policy
style): no I/O, no clock, no mutation, so tests drive them with hand-built snapshots. A
:class:`Decision` carries the :class:`Assignment` of nodes to executors, in order, and the vTime
lifts of tenants that (re)joined.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from libs.protocol.ids import ModelKey, NodeRef


@dataclass(frozen=True, slots=True, eq=False)
class ReadyNode:
    """A node ready to run, as a policy sees it. Compared by identity: a snapshot holds each ready
    node once, and policies remove the one they placed from their working list (a hot path)."""

    ref: NodeRef
    tenant: str
    fn: str
    model: str
    order: int  # topological position inside its request
    submitted_at: float  # when the request arrived (monotonic seconds)
    ready_since: float  # when the node became ready
    inputs: tuple[tuple[str, int], ...] = ()  # (executor holding an input, bytes) per tensor input
    est_s: float = 0.0  # estimated run time (fetch + execute + store), from history
    load_s: float = 0.0  # estimated load time from disk, charged when the executor lacks the model
    remaining_s: float = 0.0  # estimated critical path from this node to the request's end
    job_s: float = 0.0  # estimated total work of the node's request (for SJF)
    load_host_s: float = 0.0  # estimated load time when the model's bytes are in the box's host tier
    # ``ref.request_id``, kept as a slot: policies read it in every sort key (a hot path).
    request_id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_id", self.ref.request_id)

    @property
    def node_id(self) -> str:
        return self.ref.node_id

    @property
    def model_key(self) -> ModelKey:
        return ModelKey(self.fn, self.model)


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    id: str
    fns: frozenset[str]
    resident: frozenset[ModelKey] = frozenset()  # models whose weights are loaded
    load: float = 0.0  # lower is less loaded (recent busy fraction)
    arena_free: int = 0  # bytes free in its tensor arena, as of its last heartbeat
    kind: str = "cpu"
    arena_capacity: int = 0  # 0: it reported no arena, so arena_free is not a constraint
    host_resident: frozenset[ModelKey] = frozenset()  # models whose bytes are in its box's host tier
    # Model -> fraction of its bytes on the device (a prefix of its layers may be resident, paper
    # §5.1); models in ``resident`` count 1.0 whether listed here or not. Shared with the executor's
    # state (replaced per heartbeat, never mutated); left out of the hash like the mutable it is.
    cached: Mapping[ModelKey, float] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    def fraction(self, key: ModelKey) -> float:
        """How much of ``key``'s model is on the device: 1.0 resident, 0.0 none."""
        return 1.0 if key in self.resident else self.cached.get(key, 0.0)


@dataclass(frozen=True, slots=True)
class TenantView:
    """What a policy knows of a tenant: its counters and whether it just (re)appeared."""

    vtime: float = 0.0  # cumulative charged GPU seconds (paper §6)
    ops: int = 0  # dispatched ModelFn executions (the VTC baseline's counter)
    returning: bool = False  # new, or back after having nothing in progress: due a lift
    active: bool = True  # has a request in progress
    rejoining: bool = False  # had no ready work waiting after the last round (all running/blocked)


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    ready: tuple[ReadyNode, ...]
    idle: tuple[ExecutorInfo, ...]
    tenants: dict[str, TenantView] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Assignment:
    node: NodeRef
    executor: str
    charge_s: float = 0.0  # the vTime estimate charged to the node's tenant at dispatch


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer: dispatches in order, and vTime lifts (tenant -> its new vTime)."""

    assignments: list[Assignment] = field(default_factory=list)
    lifts: dict[str, float] = field(default_factory=dict)
    op_lifts: dict[str, int] = field(default_factory=dict)


def charge_for(node: ReadyNode, ex: ExecutorInfo) -> float:
    """The estimate charged at dispatch: run time, plus the load the executor would do — none when
    the model is resident, else the part of it not on the device (``1 - fraction`` of the whole-model
    load) from host memory when its bytes are in the box's host tier, else from disk. The completion
    replaces it with the measured time (and the tier the load really used)."""
    key = node.model_key
    frac = ex.fraction(key)
    if frac >= 1.0:
        return node.est_s
    return node.est_s + (1.0 - frac) * (node.load_host_s if key in ex.host_resident else node.load_s)


def best_fit(node: ReadyNode, executors: Iterable[ExecutorInfo]) -> ExecutorInfo | None:
    """The idle executor that suits ``node`` best (docs/scheduling.md, "The policy").

    Only executors that can run its ModelFn and have room for it: a consumer allocates the inputs it
    pulls from other executors in its own arena, so an executor that reported an arena
    (``arena_capacity > 0``) whose ``arena_free`` is less than the node's input bytes held elsewhere
    is no fit. Among those: most of the model already on the device first (the largest fraction of
    its bytes: fully resident means no load on the critical path, a resident prefix of its layers a
    shorter one), then its bytes in the box's host tier (a load without disk), then the most input
    bytes already local (no transfer), then the least loaded; the id breaks ties so the choice is
    deterministic.
    """
    local: dict[str, int] = {}
    total = 0
    for holder, nbytes in node.inputs:
        local[holder] = local.get(holder, 0) + nbytes
        total += nbytes
    model = node.model_key
    best: tuple | None = None
    choice: ExecutorInfo | None = None
    for ex in executors:
        if node.fn not in ex.fns:
            continue
        here = local.get(ex.id, 0)
        if ex.arena_capacity > 0 and total - here > ex.arena_free:
            continue
        frac = 1.0 if model in ex.resident else ex.cached.get(model, 0.0)
        rank = (-frac, model not in ex.host_resident, -here, ex.load, ex.id)
        if best is None or rank < best:
            best, choice = rank, ex
    return choice


def place_in_order(nodes: Iterable[ReadyNode], snapshot: Snapshot) -> list[Assignment]:
    """Give each node, in the given priority order, its best-fit executor among those still free."""
    free = {e.id: e for e in snapshot.idle}
    out: list[Assignment] = []
    for node in nodes:
        if not free:
            break
        ex = best_fit(node, free.values())
        if ex is not None:
            out.append(Assignment(node.ref, ex.id, charge_for(node, ex)))
            del free[ex.id]
    return out
