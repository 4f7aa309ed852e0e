"""Bootstrapping a box's NVSHMEM world through Redis (``T2I_EXECUTOR_TRANSPORT=nvshmem``).

NVSHMEM's UID bootstrap needs rank 0's 128-byte unique id at every other PE before they all call
``init`` together (:class:`~libs.dataplane.transport.nvshmem.NvshmemTransport`). The box's
executors already share a Redis for their GPU lease, so the id goes through it: rank 0 (the
executor holding the box's GPU 0) publishes it under the world's key with a TTL, and the others poll
for it. The key names the world's *generation*: a world is fixed for its lifetime, so a box whose
PE died starts a new generation rather than re-joining the old one, and a restarted rank 0 never
hands a late joiner the id of a world that is gone.

Nothing here imports torch or NVSHMEM: the exchange is plain Redis, tested on the CPU.
"""

from __future__ import annotations

import time
from typing import Any

from libs.dataplane.errors import DataPlaneError
from libs.dataplane.transport.nvshmem import UidExchange

UID_BYTES = 128  # nvshmemx_uniqueid_t


def world_key(namespace: str, scope: str, generation: int) -> str:
    """The Redis key of a box's NVSHMEM world id: under ``{ns}:gpu:`` (the executors' Redis user
    reaches that prefix only, as for the GPU lease), one per box scope and world generation."""
    return f"{namespace}:gpu:{scope}:nvshmem:{generation}"


def redis_uid_exchange(
    client: Any, key: str, *, ttl_s: float = 600.0, timeout_s: float = 300.0, poll_s: float = 0.05
) -> UidExchange:
    """``exchange_uid`` for :class:`NvshmemTransport` over a blocking Redis ``client``: rank 0's
    call (with its id) publishes it under ``key`` for ``ttl_s``, failing if the key is already
    taken (two rank 0s in one world generation); every other rank's call (with None) waits for
    it, up to ``timeout_s``, and checks its size."""

    def exchange(uid: bytes | None) -> bytes:
        if uid is not None:
            if len(uid) != UID_BYTES:
                raise DataPlaneError(f"an NVSHMEM unique id is {UID_BYTES} bytes, not {len(uid)}")
            if not client.set(key, uid, nx=True, px=int(ttl_s * 1000)):
                raise DataPlaneError(f"{key}: another rank 0 already published this world's id")
            return uid
        deadline = time.monotonic() + timeout_s
        while True:
            got = client.get(key)
            if got is not None:
                if len(got) != UID_BYTES:
                    raise DataPlaneError(f"{key} holds {len(got)} bytes, not an NVSHMEM unique id")
                return bytes(got)
            if time.monotonic() >= deadline:
                raise DataPlaneError(f"no NVSHMEM world id under {key} after {timeout_s:g} s: is rank 0 up?")
            time.sleep(poll_s)

    return exchange
