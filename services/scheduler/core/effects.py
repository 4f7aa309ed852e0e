"""What the scheduler core asks its shell to do: the effects returned by every core call."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.protocol.ids import AttemptRef
from libs.protocol.messages import CallbackReady, CancelNode, Dispatch, RequestResult
from libs.protocol.tensor_meta import TensorMeta


@dataclass(frozen=True)
class SendDispatch:
    """Send a node to an executor. ``token`` names the dispatch in its answer
    (``events.DispatchAnswer``); past ``deadline`` (monotonic) it is timed out, and one not sent by
    then is not sent at all. The core leaves both 0; the machine stamps them."""

    executor: str
    msg: Dispatch
    token: int = 0
    deadline: float = 0.0


@dataclass(frozen=True)
class SendCallback:
    """Tell the executor running a node where a callback input it is waiting for now lives."""

    executor: str
    msg: CallbackReady


@dataclass(frozen=True)
class SendCancel:
    """Tell an executor to stop a node (over its time limit, or its request ended)."""

    executor: str
    msg: CancelNode


@dataclass(frozen=True)
class ReleaseAttempt:
    """Tell every executor to free the tensors of one attempt of a request."""

    attempt: AttemptRef


@dataclass(frozen=True)
class PersistRequest:
    """Write request state to Redis (``fields`` go into the request hash)."""

    request_id: str
    fields: dict[str, str | int | float]
    tensors: dict[str, TensorMeta] = field(default_factory=dict)  # tensor id -> meta, to add
    drop_tensors: bool = False  # delete its tensor metadata first (the request ended, or lost some)


@dataclass(frozen=True)
class AppendEvent:
    """Append a progress event to the request's stream ``{ns}:events:{id}`` (``progress.py``); the
    outbox adds the wall-clock time ``t``."""

    request_id: str
    data: dict


@dataclass(frozen=True)
class Finished:
    result: RequestResult
    tenant: str


@dataclass(frozen=True)
class ChargeVTime:
    """Change a tenant's counters in Redis, atomically (one Lua script; paper §6 accounting).

    ``set_vtime`` sets the vTime first (a joining tenant's lift, Algorithm 1); ``delta`` is then
    added (an estimate at dispatch, measured − estimate on completion); ``service_s`` accumulates
    measured GPU time only (what fairness is judged by); ``ops`` counts dispatched ModelFns (VTC).
    """

    tenant: str
    delta: float = 0.0
    set_vtime: float | None = None
    ops: int = 0
    op_floor: int | None = None
    service_s: float = 0.0


@dataclass(frozen=True)
class StepDown:
    """This leader must stop acting at once (an executor refused a dispatch for a newer epoch)."""

    reason: str


@dataclass(frozen=True)
class CancelDone:
    """A cancel was carried out: its entry in ``{ns}:cancels`` can go."""

    request_id: str


@dataclass(frozen=True)
class WriteBacklog:
    """The backlog's per-tenant counts, for ``{ns}:backlog`` (written when changed, and every
    ``view_s`` to renew its TTL: the writer decides)."""

    counts: dict[str, int]


@dataclass(frozen=True)
class WriteViews:
    """The operator views, every ``view_s``: per tenant (``{ns}:tenants``, also the metrics) and per
    executor (``{ns}:executors``); ``stats`` is logged when set (every 10 s)."""

    tenants: dict[str, dict]
    backlog: dict[str, int]
    executors: dict[str, dict]
    stats: dict[str, int] | None = None


@dataclass(frozen=True)
class BroadcastLive:
    """Tell every executor which attempts are in progress (``LiveAttempts``): they free any other."""

    attempts: list[str]


Effect = (
    SendDispatch
    | SendCallback
    | SendCancel
    | ReleaseAttempt
    | PersistRequest
    | AppendEvent
    | Finished
    | ChargeVTime
    | StepDown
    | CancelDone
    | WriteBacklog
    | WriteViews
    | BroadcastLive
)
