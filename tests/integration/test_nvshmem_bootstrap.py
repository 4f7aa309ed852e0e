"""A box's NVSHMEM world bootstraps through Redis (libs/dataplane/transport/bootstrap.py): rank 0's
unique id reaches every other rank, a second rank 0 of the same world generation is refused, a rank
waiting for a rank 0 that never comes gives up naming the key, and an executor asked for the
nvshmem transport without a GPU lease (its rank) or a world size says what is missing. The world
itself needs GPUs: tests/unit/test_nvshmem_transport.py (marked nvshmem)."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import redis

from libs.dataplane.errors import DataPlaneError
from libs.dataplane.transport.bootstrap import UID_BYTES, redis_uid_exchange, world_key


@pytest.fixture
def client(common):
    r = redis.Redis.from_url(common.redis_url)
    yield r
    r.close()


def test_rank_zeros_unique_id_reaches_every_other_rank_through_redis(client, common):
    key = world_key(common.namespace, "box", 0)
    assert key.startswith(f"{common.namespace}:gpu:")  # what the executors' Redis user may reach
    uid = os.urandom(UID_BYTES)
    got: dict[int, bytes] = {}

    def rank(r: int) -> None:
        got[r] = redis_uid_exchange(client, key, timeout_s=30.0)(None)

    waiting = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 3)]
    for t in waiting:
        t.start()  # they wait for rank 0, which comes later
    assert redis_uid_exchange(client, key)(uid) == uid
    for t in waiting:
        t.join(30.0)
    assert got == {1: uid, 2: uid, 3: uid}
    assert 0 < client.pttl(key) <= 600_000  # gone by itself once the world is long up

    with pytest.raises(DataPlaneError, match="another rank 0"):
        redis_uid_exchange(client, key)(os.urandom(UID_BYTES))
    assert client.get(key) == uid  # the first world's id stands
    # The next generation of the box's world (after a PE died) has a key of its own.
    assert redis_uid_exchange(client, world_key(common.namespace, "box", 1))(b"\x01" * UID_BYTES)


def test_a_rank_waiting_for_a_rank_zero_that_never_comes_gives_up_naming_the_key(client, common):
    key = world_key(common.namespace, "box", 7)
    with pytest.raises(DataPlaneError, match=f"no NVSHMEM world id under {key}"):
        redis_uid_exchange(client, key, timeout_s=0.3)(None)
    client.set(key, b"short")
    with pytest.raises(DataPlaneError, match="not an NVSHMEM unique id"):
        redis_uid_exchange(client, key, timeout_s=1.0)(None)
    with pytest.raises(DataPlaneError, match="128 bytes"):
        redis_uid_exchange(client, world_key(common.namespace, "box", 8))(b"too short")


def test_the_nvshmem_transport_needs_the_gpu_lease_for_its_rank_and_the_worlds_size():
    import asyncio
    from contextlib import AsyncExitStack

    from services.executor.__main__ import nvshmem_transport
    from services.executor.config import ExecutorConfig

    common = SimpleNamespace(namespace="t", redis_url="redis://127.0.0.1:6379/0")
    cfg = ExecutorConfig(transport="nvshmem", nvshmem_world=2, device="cuda")
    with pytest.raises(SystemExit, match="T2I_EXECUTOR_GPU_LEASE=true"):
        asyncio.run(nvshmem_transport(AsyncExitStack(), cfg, common, None, "e"))
    lease = SimpleNamespace(index=2, gpus=["0", "1", "2"])
    with pytest.raises(SystemExit, match="NVSHMEM_WORLD=2"):
        asyncio.run(nvshmem_transport(AsyncExitStack(), cfg, common, lease, "e"))  # GPU 2 in a world of 2
    with pytest.raises(SystemExit, match="at most its 3 GPUs"):
        asyncio.run(nvshmem_transport(AsyncExitStack(), ExecutorConfig(nvshmem_world=4), common, lease, "e"))
