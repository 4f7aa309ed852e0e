"""The operator's view, for admin keys: tenants (vTime, service, queued and running work), each
tenant's limits and their overrides (``limits.py``), and the scheduler's executors."""

from __future__ import annotations

import msgspec
from aiohttp import web

from services.gateway.auth import TENANT
from services.gateway.body import BUS_PAYLOAD_LIMIT, json_object, read_json
from services.gateway.context import BRIDGE, LIMITS
from services.gateway.errors import ApiError
from services.gateway.limits import parse_overrides
from services.gateway.routes import require_admin


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/admin/tenants", admin_tenants)
    router.add_get("/v1/admin/executors", admin_executors)
    router.add_get("/v1/admin/tenants/{tenant}/limits", get_tenant_limits)
    router.add_put("/v1/admin/tenants/{tenant}/limits", put_tenant_limits)


async def admin_tenants(request: web.Request) -> web.Response:
    """Per-tenant cumulative vTime, measured service and queued/running work (operator view)."""
    require_admin(request, "the tenant view")
    view = await request.app[BRIDGE].tenant_view()
    data = [{"tenant": t, **v} for t, v in sorted(view.items())]
    return web.json_response({"object": "list", "data": data})


def _tenant_param(request: web.Request) -> str:
    tenant = request.match_info["tenant"]
    if not TENANT.match(tenant):
        raise ApiError(404, f"no tenant {tenant[:64]!r}", param="tenant", code="not_found")
    return tenant


async def get_tenant_limits(request: web.Request) -> web.Response:
    """A tenant's effective queued limit and GPU-second quota, its overrides, and its usage."""
    require_admin(request, "tenant limits")
    return web.json_response(await request.app[LIMITS].describe(_tenant_param(request)))


async def put_tenant_limits(request: web.Request) -> web.Response:
    """Override a tenant's queued limit and/or GPU-second quota (null: back to the default)."""
    require_admin(request, "setting tenant limits")
    tenant = _tenant_param(request)
    overrides = parse_overrides(json_object(await read_json(request, BUS_PAYLOAD_LIMIT)))
    limits = request.app[LIMITS]
    await limits.set_overrides(tenant, overrides)
    return web.json_response(await limits.describe(tenant))


async def admin_executors(request: web.Request) -> web.Response:
    """``GET /v1/admin/executors``: each executor's ModelFns, resident models and load, as the
    scheduler last wrote them (refreshed about every second)."""
    require_admin(request, "the executor view")
    bridge = request.app[BRIDGE]
    key = bridge.keys.executors_view
    view = await bridge.redis.hgetall(key)
    data = []
    for raw_id, raw in sorted(view.items()):
        try:
            item = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            continue
        if isinstance(item, dict):
            data.append({"id": raw_id.decode(errors="replace"), **item})
    return web.json_response({"object": "list", "data": data})
