"""Errors of the scheduler core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from libs.errors import T2IError

if TYPE_CHECKING:
    from libs.protocol.ids import NodeRef
    from services.scheduler.core.lifecycle import NodeState


class SchedulerError(T2IError):
    """Base of every error the scheduler core raises."""


class IllegalTransition(SchedulerError):
    """A node was asked to move from a state that transition does not start from.

    Stale or duplicated events off the bus are not this: the core recognises and drops those before
    touching a node. This is a bug in the core; the shell logs it and keeps serving.
    """

    def __init__(self, node: NodeRef, from_state: NodeState, to_state: NodeState) -> None:
        self.node = node
        self.from_state = from_state
        self.to_state = to_state
        super().__init__(f"node {node}: illegal transition {from_state.value} -> {to_state.value}")
