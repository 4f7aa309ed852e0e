"""``GET /v1/models`` and ``GET /v1/models/{id}``: the workflows as OpenAI's model objects
(``created`` and ``owned_by`` as ``models.py`` keeps them)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from libs.workflow.capabilities import summary
from services.gateway.context import BRIDGE
from services.gateway.models import ModelList, infos, lookup_workflow, model_object


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/models", list_models)
    router.add_get("/v1/models/{id}", get_model)


async def list_models(request: web.Request) -> web.Response:
    workflows = (await request.app[BRIDGE].registry.list()).workflows
    found = await infos(request.app, [w.name for w in workflows])
    body = ModelList(data=[model_object(w, found[w.name]) for w in workflows])
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def get_model(request: web.Request) -> web.Response:
    spec = await lookup_workflow(request.app[BRIDGE], request.match_info["id"], param="id")
    info = (await infos(request.app, [spec.name]))[spec.name]
    body = model_object(summary(spec), info)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")
