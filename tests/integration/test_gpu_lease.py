"""The GPU lease on a real Redis: executors of one box each claim a different GPU."""

from __future__ import annotations

import asyncio
import sys

import pytest
from redis.asyncio import Redis

from libs.common.gpu_lease import GpuLease, GpuLeaseError, lease_key, visible_gpus
from tests.support.waiting import until

GPUS = ["0", "1", "2", "3"]


@pytest.fixture
async def redis(common):
    r = Redis.from_url(common.redis_url)
    yield r
    await r.aclose()


def lease(redis, ns, owner, **kw) -> GpuLease:
    kw = {"ttl_s": 5.0, "wait_s": 0.0, "poll_s": 0.05} | kw
    return GpuLease(redis, ns, kw.pop("gpus", GPUS), owner=owner, **kw)


async def renewed(redis, key: str, times: int) -> bool:
    """Whether ``key``'s TTL was renewed ``times`` times (within a bound): between renewals it only
    falls, so each rise is one (gone, it reads -2: a lapse)."""
    last, rises = await redis.pttl(key), 0

    async def rose() -> bool:
        nonlocal last, rises
        ttl = await redis.pttl(key)
        last, rises = ttl, rises + (ttl > last)
        return rises >= times

    return await until(rose, within_s=30.0)


async def test_executors_starting_together_claim_distinct_gpus_lowest_first(redis, common):
    leases = [lease(redis, common.namespace, f"exec-{i}") for i in range(4)]
    claimed = await asyncio.gather(*(x.claim() for x in leases))
    assert sorted(claimed) == GPUS
    for x in leases:
        assert await redis.get(x.key) == x.token.encode()
        ttl = await redis.pttl(x.key)
        assert 0 < ttl <= 5000
    # A fifth finds every GPU leased and says so.
    with pytest.raises(GpuLeaseError, match="all 4 GPUs"):
        await lease(redis, common.namespace, "exec-4").claim()
    # Another box (scope) has its own GPUs 0-3.
    other = lease(redis, common.namespace, "exec-b0", scope="box-b")
    assert await other.claim() == "0"
    for x in (*leases, other):
        assert await x.release()


async def test_release_frees_the_gpu_for_the_next_executor(redis, common):
    first, second = lease(redis, common.namespace, "a"), lease(redis, common.namespace, "b")
    assert await first.claim() == "0" and await second.claim() == "1"
    assert await first.release()
    assert not await first.release()  # already gone: a no-op
    third = lease(redis, common.namespace, "c")
    assert await third.claim() == "0"
    # A stale owner can neither refresh nor release a lease another now holds.
    assert not await first.refresh()
    assert await redis.get(third.key) == third.token.encode()
    assert await second.release() and await third.release()


async def test_an_expired_lease_is_reclaimed_and_its_old_owner_learns_it_lost_it(redis, common):
    crashed = lease(redis, common.namespace, "crashed", ttl_s=1.0)
    assert await crashed.try_claim() == "0"  # then it hangs: nothing refreshes its lease
    waiting = lease(redis, common.namespace, "next", gpus=["0"], wait_s=10.0)
    assert await waiting.claim() == "0"  # waited for the crashed executor's lease to lapse
    assert await redis.get(waiting.key) == waiting.token.encode()
    with pytest.raises(GpuLeaseError, match="lost the lease of GPU 0"):
        await asyncio.wait_for(crashed.run(), timeout=10)
    assert await waiting.release()


async def test_a_held_lease_is_kept_alive_from_the_claim_on(redis, common):
    held = lease(redis, common.namespace, "held", ttl_s=1.0)
    await held.claim()  # refreshing starts here, before the executor's (slow) start-up
    # Six renewals, one every third of the TTL: the key has outlived twice its TTL, kept by them.
    assert await renewed(redis, held.key, 6), "the claimed lease was not refreshed"
    assert await redis.get(held.key) == held.token.encode()
    with pytest.raises(GpuLeaseError):
        await lease(redis, common.namespace, "x", gpus=["0"]).claim()
    runner = asyncio.ensure_future(held.run())
    await asyncio.sleep(0)  # run() starts: it awaits the refreshing
    assert not runner.done()
    runner.cancel()  # the service stopping: the lease stays until release()
    await asyncio.gather(runner, return_exceptions=True)
    assert runner.cancelled()
    # Renewed over a TTL after run() was cancelled: the refreshing outlived it.
    assert await renewed(redis, held.key, 4), "cancelling run() stopped the refreshing"
    assert await redis.get(held.key) == held.token.encode()
    assert await held.release()
    assert await redis.get(lease_key(common.namespace, "box", "0")) is None


async def test_a_lease_refreshed_from_its_thread_outlives_an_event_loop_blocked_for_three_ttls(redis, common):
    """An executor's start-up blocks its loop (importing torch and diffusers on a loaded box took
    longer than the lease's TTL here): the keeper thread refreshes on its own connection meanwhile,
    so the GPU is never free for a second executor to claim."""
    from libs.common.redis_conn import connect_redis_sync
    from tests.support.waiting import elapse_sync

    keeper = connect_redis_sync(common.redis_url, 0.3)
    held = lease(redis, common.namespace, "a", gpus=["0"], ttl_s=1.0, keeper_redis=keeper)
    try:
        await held.claim()
        elapse_sync(3.0, because="the event loop is blocked (an import) for three TTLs")
        assert held.refreshes >= 3, held.refreshes
        other = lease(redis, common.namespace, "b", gpus=["0"], ttl_s=1.0)
        assert await other.try_claim() is None, "the GPU lapsed while the loop was blocked"
        assert await redis.get(held.key) == held.token.encode()
        # A lease taken from under it: the thread tells run(), which raises (the executor stops).
        await redis.set(held.key, "another-executor", px=5000)
        with pytest.raises(GpuLeaseError, match="lost the lease"):
            await asyncio.wait_for(held.run(), 10.0)
    finally:
        await held.release()
        keeper.close()


def test_apply_points_cuda_at_the_claimed_gpu_only():
    x = GpuLease.__new__(GpuLease)
    x.gpu, x.index = "GPU-1234", 2
    env: dict[str, str] = {}
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        pytest.skip("CUDA already initialised in this process")
    assert x.apply("cuda", env) == "cuda" and env == {"CUDA_VISIBLE_DEVICES": "GPU-1234"}
    cpu_env: dict[str, str] = {}
    assert x.apply("cpu", cpu_env) == "cpu" and cpu_env == {}  # a stand-in keeps its device
    with pytest.raises(GpuLeaseError, match="cuda"):
        x.apply("mps", env)
    # A device transport (CUDA IPC, NVSHMEM) keeps every GPU visible, for the peers' memory: the
    # executor then names its own by index.
    wide: dict[str, str] = {}
    assert x.apply("cuda", wide, narrow=False) == "cuda:2" and wide == {}
    assert x.apply("cpu", wide, narrow=False) == "cpu"


async def test_cpu_executors_standing_in_for_gpus_each_hold_a_lease_and_report_it(
    broker_urls, tmp_path, redis
):
    """What compose runs on a box without GPUs: real executor processes on the CPU with the lease
    on (``T2I_EXECUTOR_GPUS=2``) claim one index each and say which in their heartbeats, so the
    operator's view (GET /v1/admin/executors) shows every executor with a GPU of its own."""
    import json
    import uuid

    from libs.launcher.stack import Stack
    from libs.protocol.keys import Keys
    from tests.conftest import cleanup_namespace, free_port
    from tests.support.waiting import until

    nats_url, redis_url = broker_urls
    stack = Stack(
        namespace="t" + uuid.uuid4().hex[:10], log_dir=tmp_path / "logs", model_root=tmp_path,
        gateway_port=free_port(), executors=2, api_keys="sk-ops=ops:admin", nats_url=nats_url,
        redis_url=redis_url, extra_env={"T2I_EXECUTOR_GPU_LEASE": "true", "T2I_EXECUTOR_GPUS": "2"},
    )  # fmt: skip
    try:
        await asyncio.to_thread(stack.start)
        ids = {f"{stack.namespace}-executor-{i}" for i in range(2)}

        async def gpus() -> dict[str, str]:
            view = await redis.hgetall(Keys(stack.namespace).executors_view)
            return {k.decode(): json.loads(v).get("gpu", "") for k, v in view.items()}

        async def both_listed_with_a_gpu() -> bool:
            listed = await gpus()
            return set(listed) == ids and all(listed.values())

        assert await until(both_listed_with_a_gpu, 60.0), await gpus()
        listed = await gpus()
        assert sorted(listed.values()) == ["0", "1"], listed
        status, body = await asyncio.to_thread(stack.http, "GET", "/v1/admin/executors", None, "sk-ops")
        assert status == 200 and sorted(e["gpu"] for e in body["data"]) == ["0", "1"]
        for gpu in ("0", "1"):  # each index leased in Redis, by one of them
            assert await redis.get(lease_key(stack.namespace, "box", gpu)) is not None
    finally:
        await asyncio.to_thread(stack.stop)
        await cleanup_namespace(nats_url, redis_url, stack.namespace)


def test_visible_gpus_from_the_setting_the_environment_or_the_devices():
    assert visible_gpus("4", {}) == GPUS
    assert visible_gpus("2,5", {}) == ["2", "5"]
    assert visible_gpus("", {"CUDA_VISIBLE_DEVICES": "3,1"}) == ["3", "1"]
    assert visible_gpus("", {"CUDA_VISIBLE_DEVICES": ""}) == []
    with pytest.raises(GpuLeaseError, match="listed twice"):
        visible_gpus("1,1", {})
    with pytest.raises(GpuLeaseError, match="must match"):
        visible_gpus("0,a b", {})
    with pytest.raises(GpuLeaseError, match="scope"):
        GpuLease(None, "t2i", GPUS, scope="a b")  # type: ignore[arg-type]
