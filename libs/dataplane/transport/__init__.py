"""Transports behind one interface (paper §5.2): shared memory, TCP, NVSHMEM.

Importing this package does not import torch or nvshmem.
"""

from __future__ import annotations

from libs.dataplane.transport.base import Transport
from libs.dataplane.transport.shm import ShmTransport
from libs.dataplane.transport.tcp import TcpTransport

__all__ = ["Transport", "ShmTransport", "TcpTransport", "make_transport"]


def make_transport(
    kind: str, *, namespace: str, executor_id: str, capacity: int, host: str = "127.0.0.1"
) -> Transport:
    """Build the transport an executor's config names.

    ``"shm"``: arena in segment ``t2i-<namespace>-<executor_id>`` (peers on this host).
    ``"tcp"``: heap arena served on ``host`` at a free port (peers anywhere).
    ``"nvshmem"`` needs world bootstrap arguments (rank, nranks, a UID exchange): construct
    ``libs.dataplane.transport.nvshmem.NvshmemTransport`` directly.
    """
    if kind == "shm":
        return ShmTransport(namespace, executor_id, capacity)
    if kind == "tcp":
        return TcpTransport(host, 0, capacity=capacity)
    if kind == "nvshmem":
        raise ValueError(
            "the nvshmem transport needs bootstrap arguments (rank, nranks, exchange_uid): "
            "construct libs.dataplane.transport.nvshmem.NvshmemTransport directly"
        )
    raise ValueError(f"unknown transport kind {kind!r} (expected 'shm', 'tcp' or 'nvshmem')")
