"""The vTime script's per-window GPU-second counter (``services/scheduler/shell/vtime_store.py``), on a
real Redis: measured service is added to ``{ns}:gpu_s:{window_s}:{index}`` in the same script that
charges it, only while the gateway has set a quota window, with a TTL of two windows; a stale
writer changes nothing, the window hash included.
"""

from __future__ import annotations

import time

import pytest
from redis.asyncio import Redis

from libs.protocol.keys import Keys
from services.scheduler.core.effects import ChargeVTime
from services.scheduler.shell.vtime_store import StaleEpoch, VTimeStore
from tests.support.waiting import until


@pytest.fixture
async def store(common):
    redis = Redis.from_url(common.redis_url)
    s = VTimeStore(redis, Keys(common.namespace))
    s.window_refresh_s = 0.0  # read the window on every charge
    yield s
    await redis.aclose()


async def windows(store: VTimeStore) -> list[bytes]:
    return [k async for k in store.redis.scan_iter(match=f"{store.keys.ns}:gpu_s:*")]


async def test_without_a_quota_window_nothing_is_counted_per_window(store):
    assert await store.apply(ChargeVTime("a", delta=0.5, ops=1, service_s=0.5)) == (0.5, 1, 0.5)
    assert await windows(store) == []


async def test_measured_service_is_added_to_the_current_window_with_a_ttl_of_two_windows(store):
    day = 86_400  # a window no run of this test straddles but one in ten million
    await store.redis.set(store.keys.quota_window, str(day))
    await store.apply(ChargeVTime("a", delta=0.25, ops=1, service_s=0.1))
    await store.apply(ChargeVTime("a", delta=-0.05, service_s=0.2))  # a correction on completion
    await store.apply(ChargeVTime("b", delta=1.0, ops=1))  # an estimate: no measured service
    await store.apply(ChargeVTime("b", set_vtime=3.0))  # a lift: no service either
    key = store.keys.gpu_window(day, int(time.time() // day))
    assert await windows(store) == [key.encode()]
    counted = await store.redis.hgetall(key)
    assert counted == {b"a": repr(0.1 + 0.2).encode()}  # exact: %.17g, as the service hash
    assert float(counted[b"a"]) == float((await store.redis.hget(store.keys.service, "a")).decode())
    assert 2 * day - 100 < await store.redis.ttl(key) <= 2 * day


def window_index(key: bytes) -> int:
    return int(key.rsplit(b":", 1)[1])


async def test_a_new_window_starts_a_new_hash(store):
    await store.redis.set(store.keys.quota_window, "1")
    await store.apply(ChargeVTime("a", service_s=1.5))
    (key,) = await windows(store)  # the window the charge fell in, whichever second it was
    first = window_index(key)
    # A new one-second window must begin: the clock passing into the next second is the event.
    assert await until(lambda: time.time() // 1 > first, 5.0, 0.01), "the clock stood still"
    after = int(time.time() // 1)
    await store.apply(ChargeVTime("a", service_s=0.5))
    (key,) = set(await windows(store)) - {key}  # a new hash, for the window the clock is in now
    second = window_index(key)
    assert after <= second <= int(time.time() // 1)
    assert await store.redis.hget(store.keys.gpu_window(1, first), "a") == b"1.5"
    assert await store.redis.hget(store.keys.gpu_window(1, second), "a") == b"0.5"
    assert await store.redis.ttl(store.keys.gpu_window(1, first)) <= 2
    assert float(await store.redis.hget(store.keys.service, "a")) == 2.0  # the total is unchanged


async def test_a_stale_writer_changes_no_window(store):
    await store.redis.set(store.keys.quota_window, "600")
    await store.redis.set(store.keys.scheduler_epoch, "5")
    store.epoch = 4
    with pytest.raises(StaleEpoch):
        await store.apply(ChargeVTime("a", delta=1.0, ops=1, service_s=1.0))
    assert await windows(store) == []
    assert await store.redis.hget(store.keys.service, "a") is None
    store.epoch = 5
    await store.apply(ChargeVTime("a", delta=1.0, ops=1, service_s=1.0))
    assert await windows(store) != []


async def test_a_malformed_window_counts_nothing_and_the_window_is_cached(store):
    await store.redis.set(store.keys.quota_window, "soon")
    await store.apply(ChargeVTime("a", service_s=1.0))
    assert await windows(store) == []
    store.window_refresh_s = 60.0
    await store.redis.set(store.keys.quota_window, "600")
    assert await store.window_s() == 0  # read less often than every charge
    store.window_refresh_s = 0.0
    assert await store.window_s() == 600


CHANGES = [
    ChargeVTime("a", delta=0.25, ops=1),  # an estimate at dispatch
    ChargeVTime("b", set_vtime=3.0),  # a lift
    ChargeVTime("a", delta=-0.05, service_s=0.2),  # a correction on completion
    ChargeVTime("b", delta=1.0 / 3.0, ops=1),
    ChargeVTime("c", op_floor=7),  # a VTC lift
    ChargeVTime("b", delta=-0.1, ops=-1),  # a refund
    ChargeVTime("c", delta=0.7, ops=1, service_s=0.7),
]


async def counters(store: VTimeStore) -> tuple[dict, dict, dict, dict]:
    key = store.keys.gpu_window(600, int(time.time() // 600))
    hashes = (store.keys.vtime, store.keys.ops, store.keys.service, key)
    return tuple([await store.redis.hgetall(h) for h in hashes])  # type: ignore[return-value]


async def test_a_batch_leaves_exactly_what_one_call_per_change_leaves(store):
    """``apply_many`` (the shell's one script call per tick) against ``apply`` per change."""
    await store.redis.set(store.keys.quota_window, "600")
    for c in CHANGES:
        await store.apply(c)
    one_by_one = await counters(store)
    for key in (store.keys.vtime, store.keys.ops, store.keys.service):
        await store.redis.delete(key)
    await store.redis.delete(store.keys.gpu_window(600, int(time.time() // 600)))
    await store.apply_many(CHANGES)
    assert await counters(store) == one_by_one
    assert one_by_one[0][b"b"] == repr(3.0 + 1.0 / 3.0 - 0.1).encode()  # exact (%.17g)


async def test_a_stale_batch_changes_nothing(store):
    await store.redis.set(store.keys.scheduler_epoch, "5")
    store.epoch = 4
    with pytest.raises(StaleEpoch):
        await store.apply_many(CHANGES)
    assert await store.redis.hgetall(store.keys.vtime) == {}
    store.epoch = 5
    await store.apply_many(CHANGES[:1])
    assert await store.redis.hget(store.keys.vtime, "a") == b"0.25"
