"""Scheduling policies: pure functions over a :class:`Snapshot`, selected by name.

The walking skeleton ships FIFO (requests in arrival order, each request's nodes in topological
order). The fair two-layer policy of the paper's Algorithm 1 and the SJF/VTC baselines share this
signature.
"""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.snapshot import Assignment, Snapshot, place_in_order

Policy = Callable[[Snapshot], list[Assignment]]


def fifo(snapshot: Snapshot) -> list[Assignment]:
    """First come, first served: the oldest request's ready nodes go first."""
    ordered = sorted(snapshot.ready, key=lambda n: (n.submitted_at, n.request_id, n.order))
    return place_in_order(ordered, snapshot)


POLICIES: dict[str, Policy] = {"fifo": fifo}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None
