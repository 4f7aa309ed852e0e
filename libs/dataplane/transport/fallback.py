"""Two transports of one executor, one in use: the box's NVSHMEM world and, for when it breaks, CUDA IPC.

An NVSHMEM world cannot take a PE back once one died (its membership is fixed at ``init``), but its
survivors can keep serving over CUDA IPC until the box forms the next world
(``services/executor/world.py``). So an executor of a world holds both: the world's symmetric arena
(``primary``) and a CUDA IPC device arena (``fallback``). :meth:`fall_back` switches, once: new outputs
and pulled copies then go to the fallback's arena (their metadata names ``cuda_ipc``), tensors already
in the world's arena stay there until released (the store frees each block in the arena that holds
it), and a pull is served by whichever transport the tensor's metadata names, into the arena in use
(an NVSHMEM get's destination need not be symmetric). Peers read our tensors through their own pair
the same way, so a box whose executors fall back at slightly different moments still moves every
tensor.

Both transports are device transports with ``read_to(meta, tensor)``; the tests stand a host-memory
CUDA IPC transport in for the world (tests/unit/test_fallback_transport.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from libs.dataplane.transport.base import Transport
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import TensorMeta

log = logging.getLogger(__name__)


class FallbackTransport(Transport):
    """``primary`` until :meth:`fall_back`, then ``fallback``; reads by the metadata's transport."""

    def __init__(self, primary: Any, fallback: Any) -> None:
        if primary.kind == fallback.kind:
            raise ValueError(f"the two transports must differ in kind, both are {primary.kind!r}")
        self.primary = primary
        self.fallback = fallback
        self._active = primary
        self._lock = threading.Lock()

    # What the store, the heartbeat and the logs read: the transport in use.
    @property
    def kind(self) -> str:  # type: ignore[override]
        return self._active.kind

    @property
    def address(self) -> str:  # type: ignore[override]
        return self._active.address

    @property
    def arena(self) -> Any:  # type: ignore[override]
        return self._active.arena

    @property
    def tags(self) -> Any:  # type: ignore[override]
        return self._active.tags

    @property
    def fell_back(self) -> bool:
        return self._active is self.fallback

    def fall_back(self) -> bool:
        """Use the fallback from now on; True if this call switched."""
        with self._lock:
            if self._active is self.fallback:
                return False
            self._active = self.fallback
        log.warning("data plane: %s -> %s from now on", self.primary.kind, self.fallback.kind)
        return True

    def for_put(self) -> Transport:
        return self._active

    def _reader(self, meta: TensorMeta) -> Any:
        for t in (self.primary, self.fallback):
            if meta.transport == t.kind:
                return t
        raise BadTensorMetaError(
            "transport",
            f"{meta.transport!r} tensor cannot be read here ({self.primary.kind!r} or {self.fallback.kind!r})",
        )

    def pull(self, meta: TensorMeta, dest: Transport, offset: int) -> None:
        reader = self._reader(meta)
        if reader is dest:
            reader.read_into(meta, offset)
        elif meta.nbytes:
            reader.read_to(meta, dest.arena.tensor(offset, meta.nbytes))

    def copies_for(self, meta: TensorMeta) -> int:
        return self._reader(meta).copies_per_pull

    def read(self, meta: TensorMeta, dst: memoryview) -> None:
        self._reader(meta).read(meta, dst)

    def read_into(self, meta: TensorMeta, offset: int) -> None:
        self.pull(meta, self._active, offset)

    def close(self) -> None:
        self.fallback.close()
        self.primary.close()

    def __repr__(self) -> str:
        return f"<FallbackTransport {self.primary!r} -> {self.fallback!r}{' (fell back)' if self.fell_back else ''}>"
