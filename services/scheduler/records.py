"""The scheduler core's records: one per executor and one per attempt at a request.

A request's nodes each have a :class:`~services.scheduler.lifecycle.NodeRecord` in the attempt's
:class:`~services.scheduler.lifecycle.NodeTable`; what belongs to the attempt as a whole (the
tensors its nodes produced, reads left on them, workflow outputs, what it cost) is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.protocol.ids import AttemptRef, ModelKey, NodeRef
from libs.protocol.messages import ImageRef, ImageRequest
from libs.protocol.tensor_meta import TensorMeta
from libs.workflow.dag import Dag, TensorSource
from services.scheduler.lifecycle import NodeTable


@dataclass
class ExecutorState:
    id: str
    kind: str
    fns: frozenset[str]
    last_seen: float
    resident: frozenset[ModelKey] = frozenset()
    host_resident: frozenset[ModelKey] = frozenset()  # models whose bytes are in its box's host tier
    arena_capacity: int = 0  # 0: the executor reported no arena (placement ignores arena_free)
    arena_free: int = 0
    running: NodeRef | None = None  # node we dispatched to it and have not seen finish
    acked_seq: int | None = None  # executor's heartbeat seq when it accepted ``running``
    foreign: tuple[NodeRef, ...] = ()  # nodes it reports running that this scheduler never dispatched
    suspect: bool = False  # a dispatch to it went unanswered: skip it until it heartbeats again
    load: float = 0.0
    load_at: float = 0.0
    malformed: frozenset[str] = frozenset()  # identifiers in its last heartbeat that did not parse

    @property
    def idle(self) -> bool:
        return self.running is None and not self.foreign and not self.suspect


@dataclass
class RequestRun:
    """One attempt at one request."""

    req: ImageRequest
    dag: Dag
    ref: AttemptRef
    arrived: float
    deadline: float
    nodes: NodeTable
    tensors: dict[TensorSource, TensorMeta | list[TensorMeta]] = field(default_factory=dict)
    reads_left: dict[TensorSource, int] = field(default_factory=dict)
    sinks: dict[str, ImageRef] = field(default_factory=dict)
    executors: set[str] = field(default_factory=set)
    bytes_moved: int = 0
    gpu_s: float = 0.0
    restarts: int = 0
    callbacks_forwarded: int = 0  # callback inputs whose metadata followed a running consumer
    job_s: float = 0.0  # estimated total work of the request

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def attempt(self) -> int:
        return self.ref.attempt


def metas_of(meta: TensorMeta | list[TensorMeta]) -> list[TensorMeta]:
    return meta if isinstance(meta, list) else [meta]
