"""Host memory for the copies to a CUDA device: buffer addresses, uint8 tensors over memory someone
else keeps alive, pinning in place (``cudaHostRegister``) and the fixed pool of page-aligned staging
chunks the disk stage reads into when there is no flat host buffer.

torch is imported inside functions: ``libs.dataplane`` stays importable without it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def buffer_address(buf: Any) -> int:
    """The address of a buffer's first byte, read-only ones included (holds no export once it
    returns)."""
    import numpy as np

    if len(memoryview(buf)) == 0:
        return 0
    array = np.frombuffer(buf, dtype=np.uint8)
    try:
        return int(array.ctypes.data)
    finally:
        del array


def _host_tensor(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of memory at ``addr`` that someone else keeps alive."""
    import numpy as np
    import torch

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
    return torch.from_numpy(array)


class _StagingPool:
    """A fixed pool of page-aligned chunks (one anonymous mmap), pinned for DMA on CUDA: disk reads
    land here and the device stage copies them out, then gives the chunk back."""

    def __init__(self, count: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._mem = mmap.mmap(-1, count * chunk_bytes)
        self.addr = buffer_address(self._mem)
        self.host = _host_tensor(self.addr, count * chunk_bytes)
        self.pinned = _cuda_register(self.addr, count * chunk_bytes)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self._free.put(i)

    def take(self) -> int:
        return self._free.get()

    def give(self, i: int) -> None:
        self._free.put(i)

    def memory(self, i: int, nbytes: int) -> memoryview:
        return memoryview(self._mem)[i * self.chunk_bytes : i * self.chunk_bytes + nbytes]

    def tensor(self, i: int, nbytes: int) -> torch.Tensor:
        return self.host[i * self.chunk_bytes : i * self.chunk_bytes + nbytes]


_CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly


def _cuda_register(addr: int, nbytes: int, read_only: bool = False) -> bool:
    """Pin host memory in place for asynchronous copies (``cudaHostRegister``; read-only mappings,
    e.g. host-tier blocks, with ``cudaHostRegisterReadOnly``); False if it failed (copies then
    still work, synchronously)."""
    import torch

    if nbytes == 0 or not torch.cuda.is_available():
        return False
    flags = _CUDA_HOST_REGISTER_READ_ONLY if read_only else 0
    rc = torch.cuda.cudart().cudaHostRegister(addr, nbytes, flags)
    code = getattr(rc, "value", rc)
    if code != 0:
        log.warning("cudaHostRegister of %d bytes failed (error %s): copies will not overlap", nbytes, code)
        return False
    return True


def _cuda_unregister(addr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(addr)


def pin_host(addr: int, nbytes: int, read_only: bool = False) -> int:
    """Pin ``nbytes`` of host memory at ``addr`` in place for DMA to a CUDA device (``read_only``:
    a read-only mapping, such as a host-tier block on a GPU box); returns ``addr`` for
    :func:`unpin_host`, or 0 where it was not pinned (copies then still work, staged by the driver)."""
    return addr if _cuda_register(addr, nbytes, read_only) else 0


def unpin_host(addr: int) -> None:
    """Undo :func:`pin_host` (a no-op for 0)."""
    if addr:
        _cuda_unregister(addr)
