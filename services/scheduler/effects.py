"""What the scheduler core asks its shell to do: the effects returned by every core call."""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.protocol.ids import AttemptRef
from libs.protocol.messages import CallbackReady, CancelNode, Dispatch, RequestResult
from libs.protocol.tensor_meta import TensorMeta


@dataclass(frozen=True)
class SendDispatch:
    executor: str
    msg: Dispatch


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


Effect = (
    SendDispatch
    | SendCallback
    | SendCancel
    | ReleaseAttempt
    | PersistRequest
    | AppendEvent
    | Finished
    | ChargeVTime
)
