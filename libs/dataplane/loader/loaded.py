"""One load's result: :class:`LoadedCheckpoint` (the tensors, per-layer readiness, how it went).

torch is imported inside functions: ``libs.dataplane`` stays importable without it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libs.dataplane.checkpoint import Index, checkpoint_id

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class LoadedCheckpoint:
    """One load of a converted checkpoint: the tensors (views of one flat buffer, on the target
    device), per-layer readiness, and how it went.

    ``layer_ready[L]`` is set once layer ``L``'s bytes (and on CUDA its device copy) have landed;
    the events are set in layer order. A failed load sets every event too (nobody waits forever):
    :meth:`wait` raises the failure, and so does :meth:`wait_layer`. ``layer_seconds[L]`` is when
    ``L``'s event was set, in seconds from the load's start (filled in as the events are set, so
    complete once the load is done; non-decreasing in layer order): a per-layer load-time profile.

    A suffix load (``first_layer`` > 0, :meth:`Loader.load`) loads only the layers
    ``index.layers[first_layer:]``: the events of the layers before are set at once (their
    ``layer_seconds`` 0.0, no ``cuda_events``), and their bytes in the buffer are unspecified."""

    def __init__(self, path: Path, index: Index, device: torch.device, first_layer: int = 0) -> None:
        self.path = path
        self.index = index
        self.device = device
        self.first_layer = first_layer
        self.key = checkpoint_id(path, index)
        self.tensors: dict[str, torch.Tensor] = {}
        self.layer_ready: dict[str, threading.Event] = {
            layer.name: threading.Event() for layer in index.layers
        }
        self.layer_seconds: dict[str, float] = {}
        self.cuda_events: dict[str, Any] = {}
        self.source = "disk"
        self.bytes_from_disk = 0
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.host_block: Any = None
        self._done = threading.Event()
        self._started = time.perf_counter()
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        for layer in index.layers[:first_layer]:  # not loaded: nothing to wait for
            self.layer_seconds[layer.name] = 0.0
            self.layer_ready[layer.name].set()

    # -- for the model's owner -------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.index.total_bytes

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> LoadedCheckpoint:
        """Block until every byte has landed; raise the load's failure if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"loading {self.path} took longer than {timeout}s")
        if self.error is not None:
            raise self.error
        return self

    def wait_layer(self, layer: str, timeout: float | None = None) -> None:
        """Block until ``layer`` has landed; raise the load's failure if it failed."""
        if not self.layer_ready[layer].wait(timeout):
            raise TimeoutError(f"layer {layer!r} of {self.path} took longer than {timeout}s")
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Release what the load holds: the host-tier block's lease (the tier may then evict the
        entry; tensors still viewing it keep their mapping). Idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._on_close:
            try:
                self._on_close.pop()()
            except Exception:
                log.exception("releasing %s", self.path)

    def __copy__(self) -> LoadedCheckpoint:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> LoadedCheckpoint:
        return self  # a copied model still names the one load its weights came from

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self.done() else "loading"
        return (
            f"LoadedCheckpoint({str(self.path)!r}, {state}, source={self.source}, "
            f"bytes_from_disk={self.bytes_from_disk}, seconds={self.seconds:.3f})"
        )

    # -- for the loader --------------------------------------------------------------------------
    def _layer_landed(self, name: str) -> None:
        """Layer ``name`` is ready: its time, then its event (a waiter then sees the time)."""
        if name not in self.layer_seconds:
            self.layer_seconds[name] = time.perf_counter() - self._started
        self.layer_ready[name].set()

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self.seconds = time.perf_counter() - self._started
        for name in self.layer_ready:
            self._layer_landed(name)
        self._done.set()
