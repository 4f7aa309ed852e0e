"""The gateway's routes, one module per resource; each has ``add_routes(router)``, which ``app.py``
calls for every module.

| module | routes |
|---|---|
| ``images.py`` | ``POST /v1/images/generations`` (synchronous, ``Prefer: respond-async``, ``Idempotency-Key``); ``GET /v1/images/files/{request_id}/{name}`` |
| ``requests.py`` | ``GET /v1/requests``, ``GET /v1/requests/{id}``, ``GET /v1/requests/{id}/events`` (SSE), ``POST /v1/requests/{id}/cancel`` |
| ``workflows.py`` | ``POST``/``GET /v1/workflows``, ``GET /v1/workflows/{name}``, ``GET /v1/workflows/{name}/dag`` |
| ``models.py`` | ``GET /v1/models``, ``GET /v1/models/{id}`` |
| ``loras.py`` | ``POST``/``GET /v1/loras``, ``GET /v1/loras/{name}`` |
| ``admin.py`` | ``GET /v1/admin/tenants``, ``GET``/``PUT /v1/admin/tenants/{tenant}/limits``, ``GET /v1/admin/executors`` |
| ``health.py`` | ``GET /healthz``, ``GET /readyz``, ``GET /metrics``, ``GET /openapi.json`` (public) |
| ``console.py`` | ``GET /console``, ``GET /console/{filename}`` (public) |

A handler parses the HTTP request, calls what does the work (a generation call's life is
``calls.Call``) and turns its result into the HTTP answer. Route modules do not import each other;
what several need is here.
"""

from __future__ import annotations

from aiohttp import web

from services.gateway.context import PRINCIPAL
from services.gateway.errors import ApiError


def require_admin(request: web.Request, what: str) -> None:
    if not request[PRINCIPAL].admin:
        raise ApiError(403, f"{what} needs an admin API key", code="forbidden")


def disconnected(request: web.Request) -> bool:
    """Whether the request's client went away (aiohttp does not cancel a handler when it does)."""
    transport = request.transport
    return transport is None or transport.is_closing()
