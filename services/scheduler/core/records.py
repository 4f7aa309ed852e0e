"""The scheduler core's record of one attempt at a request (executors: ``executors.py``).

A request's nodes each have a :class:`~services.scheduler.core.lifecycle.NodeRecord` in the attempt's
:class:`~services.scheduler.core.lifecycle.NodeTable`; what belongs to the attempt as a whole (the
tensors its nodes produced, reads left on them, workflow outputs, what it cost) is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.protocol.ids import AttemptRef
from libs.protocol.messages import (
    ConstInput,
    ImageInput,
    ImageRef,
    ImageRequest,
    InputBinding,
    LoraInput,
    PendingInput,
    TensorInput,
    TensorListInput,
)
from libs.protocol.tensor_meta import TensorMeta
from libs.workflow.dag import Const, Dag, ImageSource, LoraSource, TensorSource
from services.scheduler.core.effects import PersistRequest
from services.scheduler.core.lifecycle import NodeRecord, NodeTable


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
    tensors_version: int = 0  # changed with every change to ``tensors``: what the memos check
    reads_left: dict[TensorSource, int] = field(default_factory=dict)
    sinks: dict[str, ImageRef] = field(default_factory=dict)
    executors: set[str] = field(default_factory=set)
    bytes_moved: int = 0
    gpu_s: float = 0.0
    restarts: int = 0
    callbacks_forwarded: int = 0  # callback inputs whose metadata followed a running consumer
    job_s: float = 0.0  # estimated total work of the request
    reruns: int = 0  # completed nodes run again after an executor was lost (lineage.py)
    rerun_s: float = 0.0  # measured GPU time of those runs: the platform's, not charged to the tenant
    # node id -> (``tensors_version`` when computed, its inputs' shape key): ``seen.input_shapes``'s cache
    shape_keys: dict[str, tuple[int, str]] = field(default_factory=dict)
    # Denoising steps (``progress.py``): each looped node's step, nodes per step, nodes of each step
    # not done yet, and the steps whose nodes all are.
    step_of: dict[str, tuple[int, str]] = field(default_factory=dict)
    step_sizes: dict[tuple[int, str], int] = field(default_factory=dict)
    step_left: dict[tuple[int, str], int] = field(default_factory=dict)
    steps_done: int = 0

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def attempt(self) -> int:
        return self.ref.attempt


def metas_of(meta: TensorMeta | list[TensorMeta]) -> list[TensorMeta]:
    return meta if isinstance(meta, list) else [meta]


def binding(run: RequestRun, rec: NodeRecord, name: str, src: object) -> InputBinding:
    """How a dispatch names one input of ``rec``; a callback input whose producer is still running
    is sent *pending* (and noted in ``rec.pending``: its metadata follows in a ``CallbackReady``)."""
    if isinstance(src, Const):
        return ConstInput(src.value)
    if isinstance(src, ImageSource):
        return ImageInput(src.ref)
    if isinstance(src, LoraSource):
        return LoraInput(src.path)
    assert isinstance(src, TensorSource)
    meta = run.tensors.get(src)
    if meta is None:  # a callback input whose producer is still running: forwarded later
        rec.pending[name] = src
        return PendingInput(src.node, src.output)
    return TensorListInput(meta) if isinstance(meta, list) else TensorInput(meta)


def persist(
    run: RequestRun,
    status: str,
    tensors: dict[str, TensorMeta] | None = None,
    drop_tensors: bool = False,
    **extra: str,
) -> PersistRequest:
    """The request state the shell writes to Redis (``outbox.py``: only what changed, per batch)."""
    fields: dict[str, str | int | float] = {
        "status": status,
        "tenant": run.req.tenant,
        "workflow": run.req.workflow,
        "attempt": run.attempt,
        "nodes_total": len(run.dag.nodes),
        "nodes_done": run.nodes.done,
        "bytes_moved": run.bytes_moved,
        "gpu_s": round(run.gpu_s, 6),
        "rerun_s": round(run.rerun_s, 6),
        "executors": ",".join(sorted(run.executors)),
        "callbacks_forwarded": run.callbacks_forwarded,
        "step": run.steps_done,
        "steps": len(run.step_sizes),
        **{k: v for k, v in extra.items() if v},
    }
    return PersistRequest(run.request_id, fields, tensors or {}, drop_tensors)
