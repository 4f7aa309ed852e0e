"""The workflows as OpenAI's model objects (``GET /v1/models``: ``routes/models.py``), and looking
a workflow up by the name a call gives as ``model``.

OpenAI clients find what they may pass as ``model`` in that list (``client.models.list()``); a
workflow is that model. OpenAI's object needs ``created`` and ``owned_by``, which the registry does
not keep (a workflow is versioned content, not an account's object), so the gateway keeps them
itself in one Redis string per workflow, ``{ns}:gw:model:{name}`` (JSON ``{"created",
"owned_by"}``, no expiry: a workflow is never deleted):

- a registration through this gateway records the registering tenant and the time, unless the
  name already has an entry (the first registration owns the name: later versions keep it);
- a workflow first seen in a listing without an entry (registered from a file, by another tool,
  or before this existed) is recorded then as ``owned_by: "system"``, so its ``created`` stays the
  same from one listing to the next.

Written with ``SET NX``, so concurrent gateways agree on the first value.
"""

from __future__ import annotations

import logging
import time

import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from libs.common.registry_client import WorkflowNotFound
from libs.protocol.keys import Keys
from libs.protocol.messages import WorkflowSummary
from libs.workflow.spec import WorkflowSpec
from libs.workflow.validate import WORKFLOW_NAME
from services.gateway.bridge import Bridge
from services.gateway.context import BRIDGE, COMMON
from services.gateway.errors import ApiError

log = logging.getLogger(__name__)


async def lookup_workflow(bridge: Bridge, name: str, param: str = "model") -> WorkflowSpec:
    """The workflow ``name`` (its latest version), or 404 naming the field ``param`` that gave it."""
    try:
        if not WORKFLOW_NAME.match(name):  # cannot exist; and a long name would not fit on the bus
            raise WorkflowNotFound(name[:64])
        return await bridge.registry.get(name)
    except WorkflowNotFound:
        name = name if len(name) <= 64 else name[:64] + "..."
        raise ApiError(
            404, f"{param}: workflow {name!r} not found", param=param, code="model_not_found"
        ) from None


class ModelInfo(msgspec.Struct):
    created: int
    owned_by: str


class Model(msgspec.Struct):
    """One workflow as an OpenAI model object (the fields after ``owned_by`` are ours)."""

    id: str
    created: int
    owned_by: str
    version: int
    description: str = ""
    sizes: list[str] = []
    params: list[str] = []
    capabilities: list[str] = []  # "generate", "edit", "inpaint" (libs/workflow/capabilities.py)
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: str = "list"


def _key(app: web.Application, name: str) -> str:
    return Keys(app[COMMON].namespace).workflow_owner(name)


async def remember(app: web.Application, name: str, owner: str) -> None:
    """Record who registered ``name`` and when, unless someone already did. Best effort: the
    registration has happened whatever this does."""
    info = ModelInfo(created=int(time.time()), owned_by=owner or "system")
    try:
        await app[BRIDGE].redis.set(_key(app, name), msgspec.json.encode(info), nx=True)
    except RedisError as e:
        log.warning("could not record the owner of workflow %s: %s", name, e)


def _decode(raw: bytes | None) -> ModelInfo | None:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=ModelInfo)
    except msgspec.DecodeError:
        return None


async def infos(app: web.Application, names: list[str]) -> dict[str, ModelInfo]:
    """``created``/``owned_by`` of each name, recording those seen for the first time. Plain
    GET/SET NX per name (a pipeline): the gateway's Redis user may run only those on its keys."""
    redis = app[BRIDGE].redis
    now = ModelInfo(created=int(time.time()), owned_by="system")
    if not names:
        return {}
    try:
        pipe = redis.pipeline(transaction=False)
        for name in names:
            pipe.set(_key(app, name), msgspec.json.encode(now), nx=True)
            pipe.get(_key(app, name))
        replies = await pipe.execute()
    except RedisError as e:  # fail open: the list matters more than its dates
        log.warning("could not read the owners of workflows: %s", e)
        return dict.fromkeys(names, ModelInfo(created=0, owned_by="system"))
    # An unreadable entry is shown as new rather than failing the list.
    return {name: _decode(raw) or now for name, raw in zip(names, replies[1::2], strict=True)}


def model_object(w: WorkflowSummary, info: ModelInfo) -> Model:
    return Model(
        id=w.name,
        created=info.created,
        owned_by=info.owned_by,
        version=w.version,
        description=w.description,
        sizes=list(w.sizes),
        params=list(w.params),
        capabilities=list(w.capabilities),
    )
