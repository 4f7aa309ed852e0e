"""The routes anyone may call without a key: liveness, readiness, Prometheus metrics
(``observe.py``) and the API's own description (``openapi.py``)."""

from __future__ import annotations

from aiohttp import web

from services.gateway import observe, openapi
from services.gateway.bridge import Bridge
from services.gateway.context import BRIDGE
from services.gateway.errors import ApiError


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/healthz", healthz)
    router.add_get("/readyz", readyz)
    router.add_get("/metrics", metrics)
    router.add_get("/openapi.json", openapi.openapi_json)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    bridge: Bridge = request.app[BRIDGE]
    if not bridge.nc.is_connected:
        raise ApiError(503, "not connected to NATS", code="unavailable")
    await bridge.registry.list()  # raises RegistryUnavailable -> 503
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format: HTTP, per-call (workflow, tenant, status) and in-flight series."""
    return await observe.metrics(request)
