"""The gateway's HTTP API (aiohttp).

| route | who | what |
|---|---|---|
| ``POST /v1/images/generations`` | tenant | OpenAI-compatible image generation (synchronous) |
| ``GET /v1/images/files/{request_id}/{name}`` | the tenant that made it | a generated PNG (``response_format: url``) |
| ``POST /v1/workflows`` | admin | register a workflow spec (versioned) |
| ``POST /v1/loras``, ``GET /v1/loras`` | admin / tenant | register (name -> safetensors path) / list LoRAs |
| ``GET /v1/workflows``, ``GET /v1/workflows/{name}`` | tenant | list / look up workflows |
| ``GET /v1/admin/tenants`` | admin | per-tenant vTime, service, queued/running counts |
| ``GET /healthz`` | anyone | the process is up |
| ``GET /readyz`` | anyone | NATS is connected and a registry answers |
| ``GET /metrics`` | anyone | Prometheus counters |

Every error answers in OpenAI's shape with the offending field in ``param``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web

from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis
from libs.common.registry_client import RegistryUnavailable, WorkflowNotFound
from libs.common.runner import close_quietly
from libs.common.settings import CommonSettings
from libs.protocol.ids import image_object
from libs.protocol.keys import Keys
from libs.protocol.messages import ImageRef, ImageRequest, LoraInfo, RequestResult
from libs.protocol.subjects import Subjects
from libs.workflow.spec import WorkflowSpec, encode_spec
from services.gateway.auth import ApiKeys, Principal, bearer
from services.gateway.bridge import Bridge
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.generation import Generation, parse_generation, parse_model
from services.gateway.inputs import resolve_inputs

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", GatewayConfig)
COMMON = web.AppKey("common", CommonSettings)
KEYS = web.AppKey("keys", ApiKeys)
BRIDGE = web.AppKey("bridge", Bridge)
METRICS = web.AppKey("metrics", Counter)
INFLIGHT = web.AppKey("inflight", list)
PRINCIPAL = web.RequestKey("principal", Principal)
PUBLIC = {"/healthz", "/readyz", "/metrics"}

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
        msg = {404: f"no route {request.method} {request.path}", 405: f"method {request.method} not allowed"}
        return ApiError(e.status, msg.get(e.status, e.reason)).response()
    except RegistryUnavailable as e:
        return ApiError(503, f"the workflow registry is unavailable: {e}", code="unavailable").response()
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal error", code="internal").response()


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in PUBLIC:
        return await handler(request)
    key = bearer(request.headers.get("Authorization"))
    if key is None:
        raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", code="missing_api_key")
    principal = request.app[KEYS].lookup(key)
    if principal is None:
        raise ApiError(401, "unknown API key", code="invalid_api_key")
    request[PRINCIPAL] = principal
    return await handler(request)


async def read_json(request: web.Request) -> object:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_body_mb
        raise ApiError(413, f"request body too large (limit {limit:g} MiB)", code="too_large") from None
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def lookup_workflow(bridge: Bridge, name: str, param: str = "model") -> WorkflowSpec:
    try:
        return await bridge.registry.get(name)
    except WorkflowNotFound:
        raise ApiError(
            404, f"{param}: workflow {name!r} not found", param=param, code="model_not_found"
        ) from None


# -- images ----------------------------------------------------------------------------------------------
async def generate(request: web.Request) -> web.Response:
    app = request.app
    cfg, bridge = app[CONFIG], app[BRIDGE]
    principal: Principal = request[PRINCIPAL]
    body = await read_json(request)
    spec = await lookup_workflow(bridge, parse_model(body))
    gen = parse_generation(body, spec, cfg.max_n)  # type: ignore[arg-type]
    gen_id = uuid.uuid4().hex[:20]
    await resolve_inputs(spec, gen.params, body, request.app[BRIDGE], gen_id)  # type: ignore[arg-type]
    inflight = app[INFLIGHT]
    if inflight[0] + gen.n > cfg.max_inflight:
        raise ApiError(
            429, f"too many images in progress (limit {cfg.max_inflight}); retry shortly", code="busy"
        )
    inflight[0] += gen.n
    try:
        return await _run_generation(request, spec, gen, principal, gen_id)
    finally:
        inflight[0] -= gen.n


async def _run_generation(
    request: web.Request, spec: WorkflowSpec, gen: Generation, who: Principal, gen_id: str
) -> web.Response:
    cfg, bridge, metrics = request.app[CONFIG], request.app[BRIDGE], request.app[METRICS]
    ids = [f"{gen_id}-{i}" for i in range(gen.n)]
    futures = [bridge.expect(rid) for rid in ids]
    t0 = time.monotonic()
    try:
        for rid, params in zip(ids, gen.params, strict=True):
            req = ImageRequest(
                request_id=rid,
                tenant=who.tenant,
                workflow=spec.name,
                version=spec.version,
                params=params,
                submitted_at=time.time(),
                timeout_s=cfg.request_timeout_s,
            )
            await bridge.submit(req)
        results = await asyncio.gather(
            *(bridge.wait(r, f, cfg.request_timeout_s + 5) for r, f in zip(ids, futures, strict=True))
        )
    finally:
        for rid in ids:
            bridge.forget(rid)
    metrics["images_requested"] += gen.n
    data = []
    for rid, seed, result in zip(ids, gen.seeds, results, strict=True):
        _raise_for(result, rid, cfg.request_timeout_s)
        assert result is not None
        ref = next(iter(result.images.values()))
        item: dict[str, object] = {}
        if gen.response_format == "url":
            base = cfg.public_url.rstrip("/") or f"{request.scheme}://{request.host}"
            item["url"] = f"{base}/v1/images/files/{ref.name}"
        else:
            png = await bridge.fetch_image(ref, delete=True)
            if png is None:
                raise ApiError(500, f"image of {rid} is missing from the object store", code="internal")
            item["b64_json"] = base64.b64encode(png).decode()
        if seed is not None:
            item["seed"] = seed
        data.append(item)
    metrics["images_generated"] += gen.n
    log.info(
        "%s: %d image(s) of %s for %s in %.2fs", gen_id, gen.n, spec.name, who.tenant, time.monotonic() - t0
    )
    return web.json_response({"id": gen_id, "created": int(time.time()), "model": spec.name, "data": data})


def _raise_for(result: RequestResult | None, rid: str, timeout: float) -> None:
    if result is None:
        raise ApiError(504, f"request {rid} did not finish within {timeout:.0f}s", code="timeout")
    if result.status == "succeeded" and result.images:
        return
    code = result.error_code or "internal"
    if code == "bad_params":
        raise ApiError(422, result.error, code=code)
    if code == "timeout":
        raise ApiError(504, result.error, code=code)
    raise ApiError(500, f"request {rid} failed: {result.error or 'no image produced'}", code=code)


async def image_file(request: web.Request) -> web.Response:
    rid, name = request.match_info["request_id"], request.match_info["name"]
    bridge: Bridge = request.app[BRIDGE]
    owner = await bridge.request_tenant(rid)
    if owner is None or owner != request[PRINCIPAL].tenant or not name.endswith(".png"):
        raise ApiError(404, f"no image {rid}/{name}", code="not_found")
    png = await bridge.fetch_image(
        ImageRef(bucket="", name=image_object(rid, name.removesuffix(".png")), nbytes=0, width=0, height=0),
        delete=False,
    )
    if png is None:
        raise ApiError(404, f"image {rid}/{name} has expired or does not exist", code="not_found")
    return web.Response(body=png, content_type="image/png")


# -- workflows -----------------------------------------------------------------------------------------
async def register_workflow(request: web.Request) -> web.Response:
    if not request[PRINCIPAL].admin:
        raise ApiError(403, "registering workflows needs an admin API key", code="forbidden")
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a workflow spec (a JSON object)", code="invalid_json")
    reply = await request.app[BRIDGE].registry.register(
        json.dumps(body).encode(), tenant=request[PRINCIPAL].tenant
    )
    if not reply.ok:
        problems = [{"path": p.path, "message": p.message} for p in reply.problems]
        param = problems[0]["path"] if problems else None
        err = {
            "message": reply.error,
            "type": "invalid_request_error",
            "param": param,
            "code": "invalid_spec",
            "problems": problems,
        }
        return web.json_response({"error": err}, status=reply.status)
    spec = json.loads(bytes(reply.spec))
    return web.json_response({"workflow": spec, "created": reply.created}, status=reply.status)


async def register_lora(request: web.Request) -> web.Response:
    if not request[PRINCIPAL].admin:
        raise ApiError(403, "registering LoRA adapters needs an admin API key", code="forbidden")
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for key in body:
        if key not in ("name", "path", "description"):
            raise ApiError(422, f"{key}: unknown field", param=key, code="invalid_value")
    for key in ("name", "path"):
        if not isinstance(body.get(key), str):
            raise ApiError(422, f"{key}: is required (a string)", param=key, code="invalid_value")
    if not isinstance(body.get("description", ""), str):
        raise ApiError(422, "description: must be a string", param="description", code="invalid_value")
    lora = LoraInfo(name=body["name"], path=body["path"], description=body.get("description", ""))
    reply = await request.app[BRIDGE].registry.register_lora(lora)
    if not reply.ok:
        param = reply.problems[0].path if reply.problems else None
        raise ApiError(reply.status, reply.error, param=param, code="invalid_value")
    data = {"lora": msgspec.to_builtins(reply.loras[0]), "created": reply.created}
    return web.json_response(data, status=reply.status)


async def list_loras(request: web.Request) -> web.Response:
    loras = await request.app[BRIDGE].registry.list_loras()
    return web.json_response({"object": "list", "data": msgspec.to_builtins(loras)})


async def list_workflows(request: web.Request) -> web.Response:
    reply = await request.app[BRIDGE].registry.list()
    return web.json_response({"object": "list", "data": msgspec.to_builtins(reply.workflows)})


async def get_workflow(request: web.Request) -> web.Response:
    version_s = request.query.get("version", "0")
    if not version_s.isdigit():
        raise ApiError(422, "version: must be a positive integer", param="version")
    try:
        spec = await request.app[BRIDGE].registry.get(request.match_info["name"], int(version_s))
    except WorkflowNotFound as e:
        raise ApiError(404, str(e), param="name", code="model_not_found") from None
    return web.json_response({"workflow": json.loads(encode_spec(spec))})


# -- admin ---------------------------------------------------------------------------------------------
async def admin_tenants(request: web.Request) -> web.Response:
    """Per-tenant cumulative vTime, measured service and queued/running work (operator view)."""
    if not request[PRINCIPAL].admin:
        raise ApiError(403, "the tenant view needs an admin API key", code="forbidden")
    view = await request.app[BRIDGE].tenant_view()
    data = [{"tenant": t, **v} for t, v in sorted(view.items())]
    return web.json_response({"object": "list", "data": data})


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
    lines = ["# TYPE t2i_gateway_inflight gauge", f"t2i_gateway_inflight {request.app[INFLIGHT][0]}"]
    for name, value in sorted(request.app[METRICS].items()):
        lines += [f"# TYPE t2i_gateway_{name}_total counter", f"t2i_gateway_{name}_total {value}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


# -- app -------------------------------------------------------------------------------------------------
async def _bridge_ctx(app: web.Application) -> AsyncIterator[None]:
    common = app[COMMON]
    nc = await connect(common.nats_url, "gateway")
    redis = connect_redis(common.redis_url)
    bridge = Bridge(nc, redis, Subjects(common.namespace), Keys(common.namespace))
    await bridge.start()
    app[BRIDGE] = bridge
    yield
    await close_quietly(bridge.stop(), "bridge")
    await close_quietly(nc.drain(), "nats")
    await close_quietly(redis.aclose(), "redis")


def make_app(cfg: GatewayConfig, common: CommonSettings, keys: ApiKeys) -> web.Application:
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware], client_max_size=int(cfg.max_body_mb * (1 << 20))
    )
    app[CONFIG] = cfg
    app[COMMON] = common
    app[KEYS] = keys
    app[METRICS] = Counter()
    app[INFLIGHT] = [0]
    app.cleanup_ctx.append(_bridge_ctx)
    app.router.add_post("/v1/images/generations", generate)
    app.router.add_get("/v1/images/files/{request_id}/{name}", image_file)
    app.router.add_post("/v1/workflows", register_workflow)
    app.router.add_get("/v1/workflows", list_workflows)
    app.router.add_get("/v1/workflows/{name}", get_workflow)
    app.router.add_post("/v1/loras", register_lora)
    app.router.add_get("/v1/loras", list_loras)
    app.router.add_get("/v1/admin/tenants", admin_tenants)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
