"""The scheduler core's records: one per executor and one per attempt at a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from libs.protocol.tensor_meta import TensorMeta
from libs.protocol.messages import ImageRef, ImageRequest
from libs.workflow.dag import Dag, TensorSource


class NodeStatus(Enum):
    WAITING = "waiting"
    READY = "ready"
    RUNNING = "running"
    DONE = "done"


@dataclass
class ExecutorState:
    id: str
    kind: str
    fns: frozenset[str]
    last_seen: float
    resident: frozenset[str] = frozenset()
    arena_free: int = 0
    running: str | None = None  # node key we dispatched and have not seen finish
    acked_seq: int | None = None  # executor's heartbeat seq when it accepted ``running``
    foreign: tuple[str, ...] = ()  # nodes it reports running that this scheduler never dispatched
    suspect: bool = False  # a dispatch to it went unanswered: skip it until it heartbeats again
    load: float = 0.0
    load_at: float = 0.0

    @property
    def idle(self) -> bool:
        return self.running is None and not self.foreign and not self.suspect


@dataclass
class RequestRun:
    """One attempt at one request."""

    req: ImageRequest
    dag: Dag
    attempt: int
    arrived: float
    deadline: float
    status: dict[str, NodeStatus]
    remaining: dict[str, int]  # node -> dependencies not yet done
    ready: dict[str, float] = field(default_factory=dict)  # node -> since (insertion ordered)
    running: dict[str, str] = field(default_factory=dict)  # node -> executor
    tensors: dict[TensorSource, TensorMeta | list[TensorMeta]] = field(default_factory=dict)
    # Callback inputs (§5.2): producers a node still waits to see *started*, and inputs that were
    # dispatched pending (node -> {input: source}) so their metadata can be forwarded on completion.
    cb_waiting: dict[str, set[str]] = field(default_factory=dict)
    pending: dict[str, dict[str, TensorSource]] = field(default_factory=dict)
    reads_left: dict[TensorSource, int] = field(default_factory=dict)
    sinks: dict[str, ImageRef] = field(default_factory=dict)
    done: int = 0
    executors: set[str] = field(default_factory=set)
    bytes_moved: int = 0
    gpu_s: float = 0.0
    retries: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    callbacks_forwarded: int = 0  # callback inputs whose metadata followed a running consumer
    # Accounting (paper §6): what each running node was charged, and what its estimate was keyed by.
    charges: dict[str, float] = field(default_factory=dict)
    shapes: dict[str, str] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    critical: dict[str, float] = field(default_factory=dict)  # node -> estimated path to the end
    job_s: float = 0.0  # estimated total work of the request

    @property
    def request_id(self) -> str:
        return self.req.request_id


def metas_of(meta: TensorMeta | list[TensorMeta]) -> list[TensorMeta]:
    return meta if isinstance(meta, list) else [meta]


def split_key(key: str) -> tuple[str, int, str]:
    request_id, attempt, node_id = key.split("/", 2)
    return request_id, int(attempt), node_id
