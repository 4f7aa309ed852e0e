"""The registry service over real NATS and Redis: validation, versioning, lookups."""

from __future__ import annotations

import json

import msgspec
import pytest

from libs.common.registry_client import RegistryUnavailable, WorkflowNotFound
from libs.models.flux_workflows import tiny_flux
from libs.protocol.messages import registry_reply_decoder
from libs.workflow.spec import encode_spec
from tests.support.registry import running_registry


@pytest.fixture
async def registry(common):
    async with running_registry(common, client_timeout_s=1.0) as r:
        client = r.client
        client.service = r.service  # a test may stop it (stop is idempotent)
        yield client, r.nc, r.subjects


def spec_json(**changes) -> bytes:
    d = json.loads(encode_spec(tiny_flux()))
    d.update(changes)
    return json.dumps(d).encode()


async def test_registering_stores_version_1_and_the_same_spec_again_is_idempotent(registry):
    client, _, _ = registry
    first = await client.register(spec_json())
    assert first.ok and first.created and first.status == 201
    assert json.loads(bytes(first.spec))["version"] == 1
    again = await client.register(spec_json())
    assert again.ok and not again.created and json.loads(bytes(again.spec))["version"] == 1


async def test_a_changed_spec_becomes_a_new_version_and_old_versions_stay_readable(registry):
    client, _, _ = registry
    await client.register(spec_json())
    second = await client.register(spec_json(description="changed"))
    assert second.created and json.loads(bytes(second.spec))["version"] == 2
    latest = await client.get("tiny-flux")
    assert latest.version == 2 and latest.description == "changed"
    v1 = await client.get("tiny-flux", 1)
    assert v1.version == 1 and v1.description != "changed"
    listed = await client.list()
    assert [(w.name, w.version) for w in listed.workflows] == [("tiny-flux", 2)]


async def test_looking_up_a_missing_workflow_raises_not_found(registry):
    client, _, _ = registry
    with pytest.raises(WorkflowNotFound):
        await client.get("nope")
    await client.register(spec_json())
    with pytest.raises(WorkflowNotFound):
        await client.get("tiny-flux", 7)


def drop_clip(d: dict) -> None:
    """Remove the CLIP node and the transformer's binding to it: nothing produces the input."""
    del d["body"][0]
    del d["body"][2]["body"][0]["inputs"]["pooled_prompt_embeds"]


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [
        (
            lambda d: d["body"].__setitem__(0, {**d["body"][0], "fn": "flux.nope"}),
            "body[0].fn",
            "unknown ModelFn",
        ),
        (drop_clip, "body[2].body[0].inputs.pooled_prompt_embeds", "bound to nothing"),
        (
            lambda d: d["params"]["seed"].__setitem__("default", "zero"),
            "params.seed.default",
            "not of type int",
        ),
        (lambda d: d["body"][2]["inputs"].__setitem__("seed", "vae.image"), "body", "cycle"),
        (lambda d: d["body"][0].__setitem__("bogus", 1), "body[0]", "unknown field"),
    ],
    ids=["unknown-modelfn", "input-nobody-produces", "bad-param-type", "cycle", "unknown-field"],
)
async def test_malformed_specs_are_rejected_naming_the_field(registry, mutate, path, fragment):
    client, _, _ = registry
    d = json.loads(encode_spec(tiny_flux()))
    mutate(d)
    reply = await client.register(json.dumps(d).encode())
    assert not reply.ok and reply.status == 422
    assert any(p.path.startswith(path) and fragment in p.message for p in reply.problems), reply.problems


async def test_garbage_on_the_bus_gets_an_error_reply_and_the_registry_keeps_serving(registry):
    client, nc, subjects = registry
    for payload in (b"not json", b'{"type":"register"}', b'{"type":"launch_missiles"}'):
        msg = await nc.request(subjects.registry("register"), payload, timeout=5)
        reply = registry_reply_decoder.decode(msg.data)
        assert not reply.ok and reply.status == 400
    reply = await client.register(b"[1, 2")
    assert not reply.ok and reply.status == 400
    assert (await client.register(spec_json())).ok
    assert msgspec.json.decode(bytes((await client.register(spec_json())).spec))["name"] == "tiny-flux"


async def test_while_the_registry_is_away_the_latest_seen_version_answers_and_nothing_else(registry):
    client, _, _ = registry
    await client.register(spec_json())
    await client.register(spec_json(description="changed"))
    assert (await client.get("tiny-flux")).version == 2
    await client.service.stop()
    away = await client.get("tiny-flux")  # the latest this client saw, though no registry answers
    assert away.version == 2 and away.description == "changed"
    assert (await client.get("tiny-flux", 2)).version == 2  # an immutable version, cached
    with pytest.raises(RegistryUnavailable):
        await client.get("tiny-flux", 1)  # never fetched: not made up
    with pytest.raises(RegistryUnavailable):
        await client.get("never-seen")
