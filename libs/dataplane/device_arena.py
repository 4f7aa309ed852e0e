"""An arena over device memory: one flat uint8 tensor carved by the buddy allocator.

The CUDA IPC transport's ``cudaMalloc`` (``transport/ipc.py``), NVSHMEM's symmetric heap
(``transport/nvshmem.py``) and, in the CPU tests, the IPC transport's host stand-in are each one
:class:`TensorArena`. Its blocks are tensor views, never memoryviews (``Arena.holds_tensors``), so an
output stays on the device it was written on and a consumer on the same executor views it.
Torch-free itself: it only slices the tensor it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from libs.dataplane.arena import Arena
from libs.dataplane.errors import ArenaClosedError, DataPlaneError


class TensorArena(Arena):
    """An arena whose memory is one flat uint8 tensor: device memory (a CUDA allocation, NVSHMEM's
    symmetric heap) or its host stand-in in the CPU tests. Blocks are tensor views
    (``tensor(offset, nbytes)``), never memoryviews, so an output stays on the device it was made on
    and a consumer on the same executor gets a view of it, not a copy. ``fence`` waits for the
    writes queued on the arena's device; ``release`` frees the memory at ``close`` (after the
    arena stops handing out blocks; tensors still viewing it must be gone by then on CUDA).

    Torch-free itself: it only slices the tensor it is given.
    """

    kind = "device"
    holds_tensors = True

    def __init__(
        self,
        name: str,
        memory: Any,
        min_block: int = 256,
        *,
        fence: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name, int(memory.numel()), min_block)
        self._memory: Any = memory
        self.device = str(memory.device)
        self._fence = fence
        self._release = release

    @property
    def buf(self) -> memoryview:
        raise DataPlaneError(
            f"arena {self.name!r} is device memory ({self.device}); use tensor(offset, nbytes)"
        )

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.buf

    def tensor(self, offset: int, nbytes: int) -> Any:
        """A uint8 tensor over ``[offset, offset+nbytes)`` of the arena (bounds-checked)."""
        memory = self._memory
        if self._closed or memory is None:
            raise ArenaClosedError(self.name)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside arena of {self.capacity} bytes")
        return memory[offset : offset + nbytes]

    @property
    def memory(self) -> Any:
        """The whole arena as one uint8 tensor."""
        return self._memory

    def fence(self) -> None:
        if self._fence is not None:
            self._fence()

    def _release_backing(self) -> None:
        self._memory = None
        release, self._release = self._release, None
        if release is not None:
            release()
