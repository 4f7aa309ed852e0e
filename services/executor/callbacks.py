"""Callback inputs whose producer was still running when the node was dispatched (paper §5.2).

The scheduler dispatches a base model once its ControlNet has *started*; the ControlNet's output
metadata follows in a ``CallbackReady`` message. The node's worker thread blocks in :meth:`wait`
only when its forward reaches the point that needs the tensor; the asyncio loop :meth:`deliver`s
the metadata whenever it arrives (before or after the wait begins). A released attempt cancels
its waits, and a wait gives up after ``timeout`` seconds with a retryable error. Nothing is kept
for requests that ended: deliveries nobody collects are dropped on release or when the node ends
(:meth:`forget`, however the node ended).

The box is keyed by :class:`~libs.protocol.ids.CallbackRef` (node and input name); it never
builds or parses identifier strings.
"""

from __future__ import annotations

import threading
from typing import Any

from libs.protocol.ids import AttemptRef, CallbackRef, NodeRef
from services.executor.outcome import NodeError


class CallbackBox:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._values: dict[CallbackRef, Any] = {}
        self._waiting: set[CallbackRef] = set()
        self._cancelled: set[CallbackRef] = set()  # waits that were cancelled (only while waiting)

    def deliver(self, ref: CallbackRef, value: Any) -> None:
        with self._cond:
            self._values[ref] = value
            self._cond.notify_all()

    def wait(self, ref: CallbackRef, timeout: float) -> Any:
        with self._cond:
            self._waiting.add(ref)
            try:
                self._cond.wait_for(lambda: ref in self._values or ref in self._cancelled, timeout)
                if ref in self._values:
                    return self._values.pop(ref)
                if ref in self._cancelled:
                    raise NodeError(f"callback input {ref} cancelled: the request was released")
                raise NodeError(f"callback input {ref} did not arrive within {timeout:.0f}s", retryable=True)
            finally:
                self._waiting.discard(ref)
                self._cancelled.discard(ref)

    def cancel(self, attempt: AttemptRef) -> None:
        """Wake every wait of ``attempt`` with an error and drop what was delivered for it."""
        with self._cond:
            self._cancelled.update(r for r in self._waiting if r.node.attempt_ref == attempt)
            for r in [r for r in self._values if r.node.attempt_ref == attempt]:
                del self._values[r]
            self._cond.notify_all()

    def forget(self, node: NodeRef) -> None:
        """Drop whatever was delivered for a node that has ended (it never asked)."""
        with self._cond:
            for r in [r for r in self._values if r.node == node]:
                del self._values[r]

    def __len__(self) -> int:
        with self._cond:
            return len(self._values) + len(self._waiting)
