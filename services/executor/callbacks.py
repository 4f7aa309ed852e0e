"""Callback inputs whose producer was still running when the node was dispatched (paper §5.2).

The scheduler dispatches a base model once its ControlNet has *started*; the ControlNet's output
metadata follows in a ``CallbackReady`` message. The node's worker thread blocks in :meth:`wait`
only when its forward reaches the point that needs the tensor; the asyncio loop :meth:`deliver`s
the metadata whenever it arrives (before or after the wait begins). A released request cancels
its waits, and a wait gives up after ``timeout`` seconds with a retryable error. Nothing is kept
for requests that ended: deliveries nobody collects are dropped on release or when the node ends.
"""

from __future__ import annotations

import threading
from typing import Any

from services.executor.outcome import NodeError


class CallbackBox:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._values: dict[str, Any] = {}
        self._waiting: set[str] = set()
        self._cancelled: set[str] = set()  # keys whose wait was cancelled (only while waiting)

    @staticmethod
    def key(node_key: str, input_name: str) -> str:
        return f"{node_key}:{input_name}"

    def deliver(self, key: str, value: Any) -> None:
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def wait(self, key: str, timeout: float) -> Any:
        with self._cond:
            self._waiting.add(key)
            try:
                self._cond.wait_for(lambda: key in self._values or key in self._cancelled, timeout)
                if key in self._values:
                    return self._values.pop(key)
                if key in self._cancelled:
                    raise NodeError(f"callback input {key} cancelled: the request was released")
                raise NodeError(f"callback input {key} did not arrive within {timeout:.0f}s", retryable=True)
            finally:
                self._waiting.discard(key)
                self._cancelled.discard(key)

    def cancel(self, request_id: str, attempt: int) -> None:
        prefix = f"{request_id}/{attempt}/"
        with self._cond:
            self._cancelled.update(k for k in self._waiting if k.startswith(prefix))
            for k in [k for k in self._values if k.startswith(prefix)]:
                del self._values[k]
            self._cond.notify_all()

    def forget(self, node_key: str) -> None:
        """Drop whatever was delivered for a node that has finished (it never asked)."""
        with self._cond:
            for k in [k for k in self._values if k.startswith(node_key + ":")]:
                del self._values[k]

    def __len__(self) -> int:
        with self._cond:
            return len(self._values) + len(self._waiting)
