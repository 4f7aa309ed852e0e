"""The scheduler's inputs: every one is a typed event on the shell's one inbox, handled by
:meth:`SchedulerMachine.handle(event, now) <services.scheduler.core.machine.SchedulerMachine.handle>`.

Events are plain data (picklable: a recording of the inbox is a list of them with their times,
``replay.py``). Nothing here carries an I/O handle: an intake message is named by its request id,
and the shell keeps the message itself to keep alive and ack.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.protocol.ids import NodeRef
from libs.protocol.messages import ExecutorGoodbye, ExecutorHeartbeat, NodeComplete, NodeFailed
from services.scheduler.core.admission import Queued


@dataclass(frozen=True, slots=True)
class Seed:
    """A new leader's starting tenant counters, read from Redis (vTime, ops, measured service)."""

    vtime: dict[str, float]
    ops: dict[str, int]
    service: dict[str, float]


@dataclass(frozen=True, slots=True)
class TakenIn:
    """A request checked at take-in (its workflow resolved, its attempt counted): to the backlog,
    unless its tenant's backlog is full."""

    item: Queued


@dataclass(frozen=True, slots=True)
class FromExecutor:
    """A validated event from an executor, on that executor's own subject."""

    event: ExecutorHeartbeat | NodeComplete | NodeFailed | ExecutorGoodbye


@dataclass(frozen=True, slots=True)
class BadCompletion:
    """A completion that did not validate (say, a non-finite time): its node is treated as lost."""

    node: NodeRef
    executor: str
    problem: str


@dataclass(frozen=True, slots=True)
class DispatchAnswer:
    """An executor's answer to dispatch ``token`` (``SendDispatch.token``), or the reason it could
    not be sent; a dispatch with no answer by its deadline is timed out by a :class:`Tick`."""

    token: int
    ok: bool
    seq: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Cancel:
    """A client's cancel; ``tenant`` None for one read from ``{ns}:cancels`` (the gateway checked
    the tenant before writing it)."""

    request_id: str
    tenant: str | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Tick:
    """The timer, every ``tick_s``: deadlines, executor liveness, dispatch timeouts, the periodic
    views. ``wall`` is the unix time (the views say when an executor was last heard from)."""

    wall: float


@dataclass(frozen=True, slots=True)
class Round:
    """The end of one batch of events taken off the inbox: admit what fits, then one scheduling
    round for everything the batch changed (none when it changed nothing a round would use)."""


Event = Seed | TakenIn | FromExecutor | BadCompletion | DispatchAnswer | Cancel | Tick | Round
