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
from libs.protocol.keys import Keys

UID_BYTES = 128  # nvshmemx_uniqueid_t


def world_key(namespace: str, scope: str, generation: int) -> str:
    """The Redis key of a box's NVSHMEM world id: under ``{ns}:gpu:`` (the executors' Redis user
    reaches that prefix only, as for the GPU lease), one per box scope and world generation."""
    return Keys(namespace).nvshmem_world(scope, generation)


#: A joiner passes the gate (counted) unless rank 0 closed it: KEYS[1] the gate. Returns 1 or 0.
_PASS = """
if redis.call('HGET', KEYS[1], 'closed') then return 0 end
redis.call('HINCRBY', KEYS[1], 'joined', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
#: Rank 0: formed if ARGV[1] joiners passed, else close the gate (nobody passes afterwards).
_CLOSE_UNLESS = """
local joined = tonumber(redis.call('HGET', KEYS[1], 'joined') or '0')
if joined >= tonumber(ARGV[1]) then return 1 end
redis.call('HSET', KEYS[1], 'closed', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 0
"""


def gate_key(world: str) -> str:
    """The join gate of the world whose id is under ``world`` (:func:`world_key`)."""
    ns, _, rest = world.partition(":gpu:")
    scope, _, generation = rest.rpartition(":nvshmem:")
    if not (ns and scope and generation.isdigit()):
        raise ValueError(f"{world!r} is not an NVSHMEM world key")
    return Keys(ns).nvshmem_gate(scope, int(generation))


def redis_uid_exchange(
    client: Any,
    key: str,
    *,
    nranks: int = 0,
    ttl_s: float = 600.0,
    timeout_s: float = 300.0,
    poll_s: float = 0.05,
) -> UidExchange:
    """``exchange_uid`` for :class:`NvshmemTransport` over a blocking Redis ``client``.

    Rank 0's call (with its id) publishes it under ``key`` for ``ttl_s``, failing if the key is
    already taken (two rank 0s in one world generation). Every other rank's call (with None) waits
    for it, up to ``timeout_s``, and checks its size. With ``nranks``, the world only forms whole:
    each other rank passes a gate (``key:gate``) before it goes on to ``init``, and rank 0 returns
    only once all ``nranks - 1`` have passed; if they have not within ``timeout_s`` rank 0 closes the
    gate and fails, and a rank arriving later fails at the gate. So either every PE calls ``init``
    or none does: none is left blocked in it waiting for a PE that gave up (the fall-back to CUDA IPC,
    services/executor/world.py). The gate is one atomic script either side, so there is no moment
    at which a rank passes and rank 0 gives up.
    """
    gate = gate_key(key)
    ttl_ms = int(ttl_s * 1000)

    def publish(uid: bytes) -> bytes:
        if len(uid) != UID_BYTES:
            raise DataPlaneError(f"an NVSHMEM unique id is {UID_BYTES} bytes, not {len(uid)}")
        if not client.set(key, uid, nx=True, px=ttl_ms):
            raise DataPlaneError(f"{key}: another rank 0 already published this world's id")
        if nranks <= 1:
            return uid
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if client.eval(_CLOSE_UNLESS, 1, gate, nranks - 1, ttl_ms):
                    return uid
                raise DataPlaneError(
                    f"{key}: only {int(client.hget(gate, 'joined') or 0)} of the world's {nranks - 1} other "
                    f"PEs joined within {timeout_s:g} s; the world is not formed"
                )
            if int(client.hget(gate, "joined") or 0) >= nranks - 1:
                return uid
            time.sleep(min(poll_s, remaining))

    def join() -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            got = client.get(key)
            if got is not None:
                if len(got) != UID_BYTES:
                    raise DataPlaneError(f"{key} holds {len(got)} bytes, not an NVSHMEM unique id")
                if nranks > 1 and not client.eval(_PASS, 1, gate, ttl_ms):
                    raise DataPlaneError(f"{key}: rank 0 stopped waiting for this world; it is not formed")
                return bytes(got)
            if time.monotonic() >= deadline:
                raise DataPlaneError(f"no NVSHMEM world id under {key} after {timeout_s:g} s: is rank 0 up?")
            time.sleep(poll_s)

    def exchange(uid: bytes | None) -> bytes:
        return publish(uid) if uid is not None else join()

    return exchange
