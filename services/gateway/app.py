"""The gateway's HTTP API (aiohttp): the application, its middleware and its connections.

:func:`make_app` builds the app: the middlewares (observability, errors, auth), the connections
and the webhook sender as cleanup contexts (opened in order at start, closed in reverse), and the
routes of every module in ``routes/`` (one per resource; the table of routes is in
``routes/__init__.py``).

Every error answers in OpenAI's shape with the offending field in ``param`` and says in
``x-should-retry`` whether repeating the call could help (``errors.py``); bodies are read strictly
and within limits (``body.py``). Every route but the public ones (``PUBLIC``, the console) needs an
API key (``auth.py``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from redis.exceptions import RedisError

from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis
from libs.common.registry_client import RegistryUnavailable
from libs.common.runner import close_quietly
from libs.common.settings import CommonSettings
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects
from services.gateway import console, observe
from services.gateway.admission import Admission
from services.gateway.auth import ApiKeys, bearer
from services.gateway.bridge import Bridge
from services.gateway.config import GatewayConfig
from services.gateway.context import (
    ADMISSION,
    BRIDGE,
    COMMON,
    CONFIG,
    DECODE_SLOTS,
    KEY_TURNS,
    KEYS,
    LIMITS,
    METRICS,
    PRINCIPAL,
    RECORDS,
    TASKS,
    WEBHOOKS,
)
from services.gateway.errors import ApiError, add_retry_header
from services.gateway.inputs import DECODE_SLOTS as DECODE_SLOT_COUNT
from services.gateway.limits import TenantLimits
from services.gateway.records import Records
from services.gateway.routes import admin, health, images, loras, models, requests, workflows
from services.gateway.routes import console as console_routes
from services.gateway.webhooks import Webhooks

log = logging.getLogger(__name__)

PUBLIC = {"/healthz", "/readyz", "/metrics", "/openapi.json"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# -- middleware -------------------------------------------------------------------------------------
@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        request.app[METRICS][f"errors_{e.status}"] += 1
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = {
            404: f"no route {request.method} {request.path[:200]}",
            405: f"method {request.method} not allowed",
        }
        return ApiError(e.status, msg.get(e.status, e.reason)).response()
    except RegistryUnavailable as e:  # its text names internal addresses: the log has it
        log.warning("%s %s: the registry is unavailable: %s", request.method, request.path, e)
        return ApiError(
            503, "the workflow registry is unavailable; retry shortly", code="unavailable"
        ).response()
    except RedisError as e:
        log.warning("%s %s: Redis is unavailable: %s", request.method, request.path, e)
        return ApiError(503, "the request store is unavailable; retry shortly", code="unavailable").response()
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal error", code="internal").response()


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in PUBLIC or console.is_public(request.path):
        return await handler(request)
    key = bearer(request.headers.get("Authorization"))
    if key is None:
        raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", code="missing_api_key")
    principal = request.app[KEYS].lookup(key)
    if principal is None:
        raise ApiError(401, "unknown API key", code="invalid_api_key")
    request[PRINCIPAL] = principal
    return await handler(request)


# -- app -------------------------------------------------------------------------------------------------
async def _bridge_ctx(app: web.Application) -> AsyncIterator[None]:
    common = app[COMMON]
    nc = await connect(common.nats_url, "gateway")
    redis = connect_redis(common.redis_url)
    bridge = Bridge(nc, redis, Subjects(common.namespace), Keys(common.namespace))
    await bridge.start()
    app[BRIDGE] = bridge
    app[RECORDS] = Records(redis, common.namespace)
    app[LIMITS] = limits = TenantLimits(app[CONFIG], redis, Keys(common.namespace))
    if app[CONFIG].tenant_gpu_s > 0:  # the scheduler counts GPU time per window from now on
        await limits.announce_window(force=True)
    app[DECODE_SLOTS] = asyncio.Semaphore(DECODE_SLOT_COUNT)
    yield
    for task in list(app[TASKS]):
        task.cancel()
    await close_quietly(bridge.stop(), "bridge")
    await close_quietly(nc.drain(), "nats")
    await close_quietly(redis.aclose(), "redis")


async def _webhooks_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    secret = cfg.webhook_secret
    if not secret:
        secret = secrets.token_hex(32)
        log.warning(
            "T2I_GATEWAY_WEBHOOK_SECRET is not set: webhooks are signed with a random secret that "
            "changes at every start (receivers cannot verify them); set one"
        )
    hooks = Webhooks(secret, cfg.webhook_attempts, cfg.webhook_backoff_s)
    await hooks.start()
    app[WEBHOOKS] = hooks
    yield
    await hooks.stop()


def make_app(cfg: GatewayConfig, common: CommonSettings, keys: ApiKeys) -> web.Application:
    app = web.Application(
        middlewares=[observe.observe_middleware, errors_middleware, auth_middleware],
        client_max_size=int(cfg.max_body_mb * (1 << 20)),
    )
    app[CONFIG] = cfg
    app[COMMON] = common
    app[KEYS] = keys
    app[METRICS] = Counter()
    observe.install(app)  # app[PROM]: Prometheus series in a registry of this app's own
    app[ADMISSION] = Admission(cfg.max_inflight, cfg.tenant_inflight)
    app[TASKS] = set()
    app[KEY_TURNS] = {}
    app.cleanup_ctx.append(_bridge_ctx)
    app.cleanup_ctx.append(_webhooks_ctx)  # after the bridge, closed before it
    app.on_response_prepare.append(add_retry_header)
    for module in (images, requests, workflows, models, loras, admin, health, console_routes):
        module.add_routes(app.router)
    return app
