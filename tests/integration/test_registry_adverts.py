"""Plugin ModelFns installed only on executors: they advertise them, the registry validates against
its own catalog united with the advertisements (real NATS and Redis)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from libs.protocol.adverts import AdvertAck, ModelFnAdvert, advertise_subject
from libs.workflow import catalog
from libs.workflow.modelfn import Signature
from libs.workflow.spec import encode_spec
from services.executor.advertise import Advertiser
from services.registry.store import AdvertStore
from tests.support import plugin_flux
from tests.support.registry import running_registry
from tests.support.waiting import until, until_sync

PLUGIN = plugin_flux.PLUGIN  # tests/plugins/t2i_example: installed here, but not in this registry


@pytest.fixture
async def registry(common):
    """A registry whose own catalog lacks the plugin, as in a control image without it."""
    own = {n: s for n, s in catalog.signatures().items() if n != PLUGIN}
    async with running_registry(common, own) as r:
        yield r.client, r.nc, r.service


def inverted_flux(fn: str = PLUGIN) -> bytes:
    """tiny-flux with a post-processing node of ModelFn ``fn`` on its image."""
    spec = plugin_flux.inverted_flux().spec()
    spec.body[-1].fn = fn
    return encode_spec(spec)


async def test_a_spec_with_a_modelfn_only_an_executor_advertises_is_accepted(registry, common):
    client, nc, _ = registry
    before = await client.register(inverted_flux())
    assert not before.ok and before.status == 422
    problem = before.problems[0]  # (then the output it would have had)
    assert problem.path.endswith(".fn") and f"unknown ModelFn {PLUGIN!r}" in problem.message
    assert "nor advertised by a running executor" in problem.message

    # An executor with the plugin installed advertises what it can run (as services.executor does).
    advertiser = Advertiser(nc, common.namespace, "exec-with-plugin", catalog.signatures(), ttl_s=60)
    ack = await advertiser.advertise()
    assert ack is not None and ack.ok and PLUGIN in ack.accepted and not ack.refused

    after = await client.register(inverted_flux())
    assert after.ok and after.created, after.error
    # A ModelFn nobody advertises is still refused, with the field named.
    missing = await client.register(inverted_flux("example.missing"))
    assert missing.status == 422 and "unknown ModelFn 'example.missing'" in missing.error
    assert missing.problems[0].path == problem.path


async def test_the_advertiser_keeps_retrying_until_a_registry_answers(common, registry, monkeypatch):
    client, nc, service = registry
    await service.stop()  # no registry for now
    advertiser = Advertiser(nc, common.namespace, "early-executor", catalog.signatures(), timeout_s=0.3)
    rounds: list[AdvertAck | None] = []  # what each of run()'s rounds got
    advertise = advertiser.advertise

    async def counted() -> AdvertAck | None:
        ack = await advertise()
        rounds.append(ack)
        return ack

    monkeypatch.setattr(advertiser, "advertise", counted)
    task = asyncio.ensure_future(advertiser.run())
    try:
        # A round has ended with no answer (nobody serves the subject): nothing acknowledged it.
        assert await until(lambda: rounds), "the advertiser never tried"
        assert rounds[0] is None and not advertiser.acked.is_set()
        await service.start()
        await asyncio.wait_for(advertiser.acked.wait(), timeout=30)
        assert rounds[-1] is not None and rounds[-1].ok and len(rounds) >= 2  # a later round
        assert (await client.register(inverted_flux())).ok
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_bad_and_expired_advertisements_do_not_widen_the_catalog(registry, common):
    client, nc, service = registry

    async def send(advert: ModelFnAdvert | bytes) -> AdvertAck:
        data = advert if isinstance(advert, bytes) else msgspec.json.encode(advert)
        reply = await nc.request(advertise_subject(common.namespace), data, timeout=2)
        return msgspec.json.decode(reply.data, type=AdvertAck)

    good = msgspec.Raw(msgspec.json.encode(Signature(inputs={"image": False}, outputs=["image"])))
    assert not (await send(b"{not json")).ok
    bad_id = await send(ModelFnAdvert(executor="a b", signatures={PLUGIN: good}))
    assert not bad_id.ok and "executor id" in bad_id.error
    mixed = await send(
        ModelFnAdvert(
            executor="e1",
            signatures={
                "example.bad": msgspec.Raw(b'{"inputs": {"x": 1}, "outputs": []}'),
                "example.odd": msgspec.Raw(b'{"inputs": {"x": false}, "outputs": ["y"], "optional": ["z"]}'),
                "not a name": good,
            },
        )
    )
    assert (
        mixed.ok
        and mixed.accepted == []
        and set(mixed.refused) == {"example.bad", "example.odd", "not a name"}
    )
    assert "not inputs" in mixed.refused["example.odd"]
    assert not (await client.register(inverted_flux())).ok
    # An advertisement that was not refreshed in time is forgotten.
    await AdvertStore(service.store.redis, common.namespace).put("gone", {PLUGIN: good}, ttl_s=-1)
    assert PLUGIN not in await service.known_fns()
    assert not (await client.register(inverted_flux())).ok


def test_executor_processes_advertise_to_the_registry_under_their_credentials(tmp_path):
    """A secured stack (a NATS user per role, Redis ACLs): simulated executor processes advertise
    their installed ModelFns, the plugin's included, and the registry stores them."""
    import json

    import redis as sync_redis

    from libs.protocol.adverts import adverts_key
    from tests.support.stacks import sim_stack, started

    with started(sim_stack(tmp_path, secure=True)) as stack:
        r = sync_redis.Redis.from_url(stack.redis_url)
        try:
            arrived = until_sync(lambda: r.hgetall(adverts_key(stack.namespace)), 30.0, 0.1)
            stored = r.hgetall(adverts_key(stack.namespace))
        finally:
            r.close()
        assert arrived and stored, "no executor advertisement reached the registry"
        ((executor, raw),) = stored.items()
        assert executor.decode().startswith(stack.namespace)
        assert PLUGIN in json.loads(raw)["signatures"]
