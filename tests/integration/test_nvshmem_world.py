"""A box's NVSHMEM world over its life, on a real Redis (services/executor/world.py,
libs/dataplane/transport/bootstrap.py): it forms whole or not at all, one that cannot form falls back
to CUDA IPC (here over the IPC transport's host backend: NVSHMEM itself needs GPUs), and when a PE
dies every survivor's watch moves the box to the next generation (once), switches its executor to CUDA
IPC at once, and ends it only when its tensors in the world's arena are released (the switch itself:
tests/unit/test_fallback_transport.py).
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest
import redis as redis_sync
from redis.asyncio import Redis

from libs.common.gpu_lease import GpuLease
from libs.dataplane.errors import DataPlaneError
from libs.dataplane.transport.bootstrap import UID_BYTES, redis_uid_exchange, world_key
from libs.dataplane.transport.ipc import CudaIpcTransport, HostBackend
from services.executor.world import (
    WorldBrokenError,
    WorldWatch,
    current_generation,
    generation_key,
    next_generation,
    open_world,
)
from tests.support.waiting import until

GPUS = ["0", "1", "2"]


@pytest.fixture
def client(common):
    r = redis_sync.Redis.from_url(common.redis_url)
    yield r
    r.close()


@pytest.fixture
async def aredis(common):
    r = Redis.from_url(common.redis_url)
    yield r
    await r.aclose()


def _ranks(
    client, key: str, nranks: int, uid: bytes, joiners: list[int], timeout_s: float
) -> dict[int, object]:
    """Rank 0 publishes ``uid``; ``joiners`` join; what each got (bytes or the error)."""
    got: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            got[r] = redis_uid_exchange(client, key, nranks=nranks, timeout_s=timeout_s)(
                uid if r == 0 else None
            )
        except DataPlaneError as e:
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in [0, *joiners]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return got


def test_a_world_forms_only_when_every_pe_joins(client, common):
    uid = os.urandom(UID_BYTES)
    got = _ranks(client, world_key(common.namespace, "box", 0), 3, uid, [1, 2], 10.0)
    assert got == {0: uid, 1: uid, 2: uid}  # everyone goes on to init together

    # Rank 2 never comes: rank 0 gives up and closes the gate, so a rank 1 that arrives after that
    # is refused too, and nobody is left blocked in init waiting for the others.
    key = world_key(common.namespace, "box", 1)
    got = _ranks(client, key, 3, uid, [], 0.5)
    assert isinstance(got[0], DataPlaneError) and "only 0 of the world's 2 other PEs joined" in str(got[0])
    with pytest.raises(DataPlaneError, match="rank 0 stopped waiting"):
        redis_uid_exchange(client, key, nranks=3, timeout_s=1.0)(None)


def test_a_world_that_cannot_form_falls_back_to_cuda_ipc(client, common):
    made: list[CudaIpcTransport] = []

    def world():
        exchange = redis_uid_exchange(client, world_key(common.namespace, "box", 5), nranks=2, timeout_s=0.2)
        exchange(None)  # rank 1: rank 0 never publishes
        raise AssertionError("unreachable")

    def ipc():
        made.append(
            CudaIpcTransport(common.namespace, f"e{uuid.uuid4().hex[:6]}", 1 << 16, backend=HostBackend())
        )
        return made[0]

    try:
        transport, formed = open_world(world, ipc, "world 5")
        assert not formed and transport is made[0] and transport.kind == "cuda_ipc"
    finally:
        for t in made:
            t.close()
    # An error that is not "cannot form" is not swallowed.
    with pytest.raises(ZeroDivisionError):
        open_world(lambda: 1 / 0, ipc, "world 6")


async def test_when_a_pe_dies_the_survivors_fall_back_then_end_and_the_box_moves_to_the_next_generation_once(
    aredis, common
):
    ns = common.namespace
    assert await current_generation(aredis, ns, "box", floor=2) == 2  # nothing recorded: the setting
    leases = [GpuLease(aredis, ns, GPUS, owner=f"pe{r}", ttl_s=5.0, wait_s=0.0) for r in range(3)]
    for lease in leases:
        await lease.try_claim()
    assert [lease.gpu for lease in leases] == GPUS
    fell: list[int] = []
    drained = [False]
    watches = [
        WorldWatch(
            aredis, ns, "box", GPUS, generation=2, period_s=0.05,
            fall_back=lambda i=i: fell.append(i), drained=lambda: drained[0],
        )
        for i in range(2)
    ]  # fmt: skip
    for w in watches:
        await w.start()
    assert [await w.dead() for w in watches] == [[], []]
    runs = [asyncio.create_task(w.run()) for w in watches]
    await asyncio.sleep(0.2)
    assert not any(r.done() for r in runs)  # a whole world: nothing happens

    await leases[1].release()  # PE 1's executor is gone
    assert await until(
        lambda: sorted(fell) == [0, 1], within_s=5.0
    )  # both survivors switch to CUDA IPC at once
    await asyncio.sleep(0.3)
    assert not any(r.done() for r in runs)  # and go on serving while the world's tensors are released
    drained[0] = True
    for r in runs:
        with pytest.raises(WorldBrokenError, match=r"lost ranks \[1\]"):
            await asyncio.wait_for(r, 5.0)
    # Both saw it; the box moved on once, and a restarted executor joins generation 3.
    assert await current_generation(aredis, ns, "box", floor=2) == 3
    assert int(await aredis.get(generation_key(ns, "box"))) == 3
    assert await next_generation(aredis, ns, "box", seen=2) == 3  # a late watcher of world 2: no second bump

    # A replacement that claimed the dead PE's GPU is not the PE the world was formed with.
    replacement = GpuLease(aredis, ns, GPUS, owner="pe1-again", ttl_s=5.0, wait_s=0.0)
    assert await replacement.try_claim() == "1"
    assert await watches[0].dead() == [1]
    fresh = WorldWatch(aredis, ns, "box", GPUS, generation=3)
    await fresh.start()  # generation 3 starts with whoever holds the GPUs now
    assert await fresh.dead() == []
    await leases[0].release()
    await leases[2].release()
    await replacement.release()
    with pytest.raises(WorldBrokenError, match="hold no GPU lease"):
        await WorldWatch(aredis, ns, "box", GPUS, generation=3).start()


async def test_the_executors_redis_user_may_do_all_of_it_and_nothing_outside_its_keys(common, aredis):
    """What compose's Redis ACL gives the executor role (libs/launcher/creds.py) is enough for the
    gate, the generation and the watch, on the real server."""
    from libs.launcher.creds import redis_rules

    ns = common.namespace
    user, password = f"{ns}-executor-acl", uuid.uuid4().hex
    await aredis.execute_command(
        "ACL", "SETUSER", user, "reset", "on", f">{password}", *redis_rules(ns, "executor")
    )
    host_url = common.redis_url.split("://", 1)[1]
    sync = redis_sync.Redis.from_url(f"redis://{user}:{password}@{host_url}")
    limited = Redis.from_url(f"redis://{user}:{password}@{host_url}")
    try:
        uid = os.urandom(UID_BYTES)
        got = _ranks(sync, world_key(ns, "box", 0), 2, uid, [1], 10.0)
        assert got == {0: uid, 1: uid}
        leases = [GpuLease(limited, ns, GPUS[:2], owner=f"pe{r}", ttl_s=5.0, wait_s=0.0) for r in range(2)]
        for lease in leases:
            await lease.try_claim()
        watch = WorldWatch(limited, ns, "box", GPUS[:2], generation=0)
        await watch.start()
        assert await watch.dead() == []
        assert await next_generation(limited, ns, "box", seen=0) == 1
        assert await current_generation(limited, ns, "box") == 1
        for lease in leases:
            await lease.release()
        with pytest.raises(redis_sync.exceptions.NoPermissionError):
            sync.hset(f"{ns}:req:x", "a", "b")  # a key outside the executor's
    finally:
        sync.close()
        await limited.aclose()
        await aredis.execute_command("ACL", "DELUSER", user)
