"""Transports behind one interface (paper §5.2): shared memory, TCP, CUDA IPC, NVSHMEM.

Importing this package does not import torch or nvshmem.
"""

from __future__ import annotations

from libs.dataplane.transport.base import Transport
from libs.dataplane.transport.shm import ShmTransport
from libs.dataplane.transport.tcp import TcpTransport
from libs.dataplane.transport.wire import DEFAULT_MAX_CONNECTIONS, DEFAULT_TIMEOUT, TOKEN_ENV

__all__ = ["TOKEN_ENV", "Transport", "ShmTransport", "TcpTransport", "make_transport"]


def make_transport(
    kind: str,
    *,
    namespace: str,
    executor_id: str,
    capacity: int,
    host: str = "127.0.0.1",
    token: str | bytes | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    device: str = "cuda",
) -> Transport:
    """Build the transport an executor's config names.

    ``"shm"``: arena in segment ``t2i-<namespace>-<executor_id>`` (peers on this host, of the
    same user: the segment is mode 0600).
    ``"tcp"``: heap arena served on ``host`` at a free port (peers anywhere). ``token`` is the
    shared secret peers authenticate with (``""`` or None: none; an executor's ``T2I_DATAPLANE_TOKEN``),
    ``timeout`` bounds every socket operation, ``max_connections`` caps the server's connections.
    ``"cuda_ipc"``: a device arena on ``device``, exported to the box's other executors through
    segment ``t2i-<namespace>-<executor_id>`` (``transport/ipc.py``).
    ``"nvshmem"`` needs world bootstrap arguments (rank, nranks, a UID exchange): construct
    ``libs.dataplane.transport.nvshmem.NvshmemTransport`` directly.
    """
    if kind == "shm":
        return ShmTransport(namespace, executor_id, capacity)
    if kind == "tcp":
        return TcpTransport(
            host, 0, capacity=capacity, token=token, timeout=timeout, max_connections=max_connections
        )
    if kind == "cuda_ipc":
        from libs.dataplane.transport.ipc import CudaIpcTransport

        return CudaIpcTransport(namespace, executor_id, capacity, device=device)
    if kind == "nvshmem":
        raise ValueError(
            "the nvshmem transport needs bootstrap arguments (rank, nranks, exchange_uid): "
            "construct libs.dataplane.transport.nvshmem.NvshmemTransport directly"
        )
    raise ValueError(f"unknown transport kind {kind!r} (expected 'shm', 'tcp', 'cuda_ipc' or 'nvshmem')")
