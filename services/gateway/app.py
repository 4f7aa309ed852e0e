"""The gateway's HTTP API (aiohttp).

| route | who | what |
|---|---|---|
| ``POST /v1/images/generations`` | tenant | OpenAI-compatible image generation (synchronous; ``Idempotency-Key``) |
| ``GET /v1/requests/{id}`` | the tenant that made it | a generation call's status, progress and result (``jobs.py``) |
| ``GET /v1/requests/{id}/events`` | the tenant that made it | the call's progress as server-sent events (``jobs.py``) |
| ``POST /v1/requests/{id}/cancel`` | the tenant that made it | cancel the call's image requests (``jobs.py``) |
| ``GET /v1/requests`` | tenant (admin: any) | recent calls, newest first (``jobs.py``) |
| ``GET /v1/admin/executors`` | admin | executors: ModelFns, resident models, load (``jobs.py``) |
| ``GET /v1/images/files/{request_id}/{name}`` | the tenant that made it | a generated image (``response_format: url``; ``.png`` as stored, ``.jpeg``/``.webp`` transcoded) |
| ``POST /v1/workflows`` | admin | register a workflow spec (versioned) |
| ``POST /v1/loras`` | admin | register a LoRA (name -> safetensors path under the model root) |
| ``GET /v1/loras``, ``GET /v1/loras/{name}`` | tenant | list / look up LoRAs (names and descriptions, never paths) |
| ``GET /v1/workflows``, ``GET /v1/workflows/{name}`` | tenant | list / look up workflows |
| ``GET /v1/workflows/{name}/dag`` | tenant | the workflow unrolled for ``?params=`` (the console's drawing) |
| ``GET /v1/admin/tenants`` | admin | per-tenant vTime, service, queued/running counts |
| ``GET``/``PUT /v1/admin/tenants/{tenant}/limits`` | admin | a tenant's queued limit and GPU-second quota, and overrides of them (``limits.py``) |
| ``GET /healthz`` | anyone | the process is up |
| ``GET /readyz`` | anyone | NATS is connected and a registry answers |
| ``GET /metrics`` | anyone | Prometheus counters |
| ``GET /v1/models``, ``GET /v1/models/{id}`` | tenant | workflows as OpenAI model objects (``models.py``) |
| ``GET /openapi.json`` | anyone | OpenAPI 3.1 document of every route (``openapi.py``) |
| ``GET /console``, ``GET /console/{filename}`` | anyone (the page asks for a key) | the web console (``console/``) |

Every error answers in OpenAI's shape with the offending field in ``param`` and says in
``x-should-retry`` whether repeating the call could help (``errors.py``); bodies are read strictly
and within limits (``body.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis
from libs.common.registry_client import RegistryUnavailable, WorkflowNotFound
from libs.common.runner import close_quietly
from libs.common.settings import CommonSettings
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects
from libs.workflow.dag import workflow_dag
from libs.workflow.errors import ParamError
from libs.workflow.spec import encode_spec
from services.gateway import console, images, jobs, loras, models, observe, openapi
from services.gateway.admission import Admission
from services.gateway.auth import TENANT, ApiKeys, bearer
from services.gateway.body import BUS_PAYLOAD_LIMIT, json_object, read_json
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
)
from services.gateway.errors import ApiError, add_retry_header
from services.gateway.inputs import DECODE_SLOTS as DECODE_SLOT_COUNT
from services.gateway.limits import TenantLimits, parse_overrides
from services.gateway.records import Records

log = logging.getLogger(__name__)

PUBLIC = {"/healthz", "/readyz", "/metrics", "/openapi.json"}
VERSION = re.compile(r"^[0-9]{1,9}$")

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


def require_admin(request: web.Request, what: str) -> None:
    if not request[PRINCIPAL].admin:
        raise ApiError(403, f"{what} needs an admin API key", code="forbidden")


# -- workflows -----------------------------------------------------------------------------------------
async def register_workflow(request: web.Request) -> web.Response:
    require_admin(request, "registering workflows")
    body = json_object(await read_json(request, BUS_PAYLOAD_LIMIT), "a workflow spec (a JSON object)")
    reply = await request.app[BRIDGE].registry.register(
        json.dumps(body).encode(), tenant=request[PRINCIPAL].tenant
    )
    if not reply.ok:
        problems = [{"path": p.path, "message": p.message} for p in reply.problems]
        param = problems[0]["path"] if problems else None
        status = reply.status if 400 <= reply.status < 600 else 502
        return ApiError(status, reply.error, param=param, code="invalid_spec").response(problems=problems)
    spec = json.loads(bytes(reply.spec))
    await models.remember(request.app, spec["name"], request[PRINCIPAL].tenant)  # GET /v1/models' owned_by
    return web.json_response({"workflow": spec, "created": reply.created}, status=reply.status)


async def list_workflows(request: web.Request) -> web.Response:
    reply = await request.app[BRIDGE].registry.list()
    return web.json_response({"object": "list", "data": msgspec.to_builtins(reply.workflows)})


async def get_workflow(request: web.Request) -> web.Response:
    version_s = request.query.get("version", "0")
    if not VERSION.match(version_s):
        raise ApiError(422, "version: must be a positive integer", param="version", code="invalid_value")
    name = request.match_info["name"]
    try:
        spec = await request.app[BRIDGE].registry.get(name, int(version_s))
    except WorkflowNotFound as e:
        raise ApiError(404, str(e), param="name", code="model_not_found") from None
    return web.json_response({"workflow": json.loads(encode_spec(spec))})


#: A DAG the console may ask for: beyond this many nodes the drawing is not readable anyway.
MAX_DAG_NODES = 2000


async def get_workflow_dag(request: web.Request) -> web.Response:
    """The workflow unrolled for ``params`` (a JSON object in the query; loop counts and the rest,
    defaults filled, required ones it does not name stood in for): the nodes the scheduler would
    run, with the ids its events carry, so the console draws them instead of unrolling the spec
    again. Node ids, ModelFns and models only: no parameter value is echoed."""
    name = request.match_info["name"]
    try:
        given = json.loads(request.query.get("params", "{}"))
    except ValueError:
        raise ApiError(422, "params: must be a JSON object", param="params", code="invalid_value") from None
    if not isinstance(given, dict):
        raise ApiError(422, "params: must be a JSON object", param="params", code="invalid_value")
    spec = await images.lookup_workflow(request.app[BRIDGE], name, param="name")
    try:
        dag = workflow_dag(spec, given, MAX_DAG_NODES)
    except ParamError as e:
        raise ApiError(
            422, f"params.{e.field}: {e.message}", param=f"params.{e.field}", code="invalid_value"
        ) from None
    nodes = [
        {"id": n.id, "fn": n.fn, "model": n.model, "deps": sorted(n.deps), "callbacks": sorted(n.cb_deps)}
        for n in dag.nodes.values()
    ]
    return web.json_response({"workflow": spec.name, "version": spec.version, "nodes": nodes})


# -- LoRA adapters ---------------------------------------------------------------------------------------
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


# -- admin ---------------------------------------------------------------------------------------------
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


# -- operations ----------------------------------------------------------------------------------------
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
    app.cleanup_ctx.append(jobs.jobs_ctx)  # webhooks: after the bridge, closed before it
    app.on_response_prepare.append(add_retry_header)
    app.router.add_post("/v1/images/generations", images.generate)
    app.router.add_get("/v1/requests", jobs.list_requests)
    app.router.add_get("/v1/requests/{id}", images.get_request)
    app.router.add_get("/v1/requests/{id}/events", jobs.events)
    app.router.add_post("/v1/requests/{id}/cancel", jobs.cancel_call)
    app.router.add_get("/v1/images/files/{request_id}/{name}", images.image_file)
    app.router.add_post("/v1/workflows", register_workflow)
    app.router.add_get("/v1/workflows", list_workflows)
    app.router.add_get("/v1/models", models.list_models)
    app.router.add_get("/v1/models/{id}", models.get_model)
    app.router.add_get("/v1/workflows/{name}", get_workflow)
    app.router.add_get("/v1/workflows/{name}/dag", get_workflow_dag)
    app.router.add_post("/v1/loras", register_lora)
    app.router.add_get("/v1/loras", list_loras)
    app.router.add_get("/v1/loras/{name}", get_lora)
    app.router.add_get("/v1/admin/tenants", admin_tenants)
    app.router.add_get("/v1/admin/executors", jobs.admin_executors)
    app.router.add_get("/v1/admin/tenants/{tenant}/limits", get_tenant_limits)
    app.router.add_put("/v1/admin/tenants/{tenant}/limits", put_tenant_limits)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi.openapi_json)
    app.router.add_get("/console", console.page)
    app.router.add_get("/console/{filename}", console.asset)
    return app
