"""LoRA adapters over HTTP: registered by admins (``POST /v1/loras``), listed and looked up by
name by everyone; what is checked and shown of one is ``loras.py``'s."""

from __future__ import annotations

from aiohttp import web

from services.gateway import loras
from services.gateway.body import BUS_PAYLOAD_LIMIT, json_object, read_json
from services.gateway.context import BRIDGE
from services.gateway.errors import ApiError
from services.gateway.routes import require_admin


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/loras", register_lora)
    router.add_get("/v1/loras", list_loras)
    router.add_get("/v1/loras/{name}", get_lora)


async def register_lora(request: web.Request) -> web.Response:
    require_admin(request, "registering LoRA adapters")
    lora = loras.parse_registration(json_object(await read_json(request, BUS_PAYLOAD_LIMIT)))
    reply = await request.app[BRIDGE].registry.register_lora(lora)
    if not reply.ok:
        param = reply.problems[0].path if reply.problems else None
        raise loras.registry_error(reply.status, reply.error, param)
    data = {"lora": loras.public(reply.loras[0] if reply.loras else lora), "created": reply.created}
    return web.json_response(data, status=reply.status)


async def list_loras(request: web.Request) -> web.Response:
    found = await request.app[BRIDGE].registry.list_loras()
    return web.json_response({"object": "list", "data": [loras.public(x) for x in found]})


async def get_lora(request: web.Request) -> web.Response:
    name = loras.lora_name(request)
    found = await request.app[BRIDGE].registry.lora(name)
    if found is None:
        raise ApiError(404, f"no LoRA {name!r}", param="name", code="not_found")
    return web.json_response({"lora": loras.public(found)})
