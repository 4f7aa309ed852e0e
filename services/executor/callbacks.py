"""Callback inputs whose producer was still running when the node was dispatched (paper §5.2).

The scheduler dispatches a base model once its ControlNet has *started*; the ControlNet's output
metadata follows in a ``CallbackReady`` message. The node's worker thread blocks in :meth:`wait`
only when its forward reaches the point that needs the tensor; the asyncio loop :meth:`deliver`s
the metadata whenever it arrives (before or after the wait begins). A released request cancels
its waits, and a wait gives up after ``timeout`` seconds with a retryable error.
"""

from __future__ import annotations

import threading
from typing import Any

from services.executor.outcome import NodeError


class CallbackBox:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._values: dict[str, Any] = {}
        self._cancelled: set[str] = set()  # "request/attempt" prefixes

    @staticmethod
    def key(node_key: str, input_name: str) -> str:
        return f"{node_key}:{input_name}"

    def deliver(self, key: str, value: Any) -> None:
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def wait(self, key: str, timeout: float) -> Any:
        group = key.rsplit("/", 1)[0]  # request/attempt
        with self._cond:
            ok = self._cond.wait_for(lambda: key in self._values or group in self._cancelled, timeout)
            if key in self._values:
                return self._values.pop(key)
        if ok:
            raise NodeError(f"callback input {key} cancelled: the request was released")
        raise NodeError(f"callback input {key} did not arrive within {timeout:.0f}s", retryable=True)

    def cancel(self, request_id: str, attempt: int) -> None:
        with self._cond:
            self._cancelled.add(f"{request_id}/{attempt}")
            self._cond.notify_all()

    def forget(self, node_key: str) -> None:
        """Drop whatever was delivered for a node that has finished (it never asked)."""
        with self._cond:
            for k in [k for k in self._values if k.startswith(node_key + ":")]:
                del self._values[k]
