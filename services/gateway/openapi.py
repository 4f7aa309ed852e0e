"""``GET /openapi.json``: an OpenAPI 3.1 document of every route the gateway serves.

The document is built from the application's own router, so a route cannot be served without
being listed: each registered (method, path) is looked up in ``OPERATIONS`` for its summary,
who may call it, its parameters and its bodies (msgspec Structs in ``schemas.py``, turned into
JSON Schema by ``msgspec.json.schema_components``; OpenAPI 3.1 uses JSON Schema 2020-12, so they
go in unchanged). A route missing from ``OPERATIONS`` is still listed, marked undocumented and
logged; ``tests/unit/test_openapi.py`` fails on it, so a new route comes with its description.
"""

from __future__ import annotations

import logging
import re
import weakref
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

import msgspec
from aiohttp import web

from libs.workflow.spec import WorkflowSpec
from services.gateway import schemas as s

log = logging.getLogger(__name__)

Who = Literal["public", "tenant", "admin"]
PATH_PARAM = re.compile(r"\{([^}:]+)(?::[^}]*)?\}")
REF = "#/components/schemas/{name}"


@dataclass(frozen=True)
class Query:
    name: str
    description: str
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string"})


@dataclass(frozen=True)
class Op:
    summary: str
    who: Who = "tenant"
    description: str = ""
    body: type | None = None
    form: type | None = None  # a multipart/form-data body (its struct: bytes fields are file parts)
    ok: type | None = None  # the JSON body of the success answer
    status: int = 200
    content_type: str = "application/json"  # of a success answer that is not JSON: its media type
    query: tuple[Query, ...] = ()
    headers: tuple[Query, ...] = ()  # request headers
    responses: dict[int, str] = field(default_factory=dict)  # other statuses worth naming


IDEMPOTENCY = Query(
    "Idempotency-Key", "1-255 printable ASCII characters; one call per key and tenant for 24 h"
)
PREFER = Query("Prefer", "`respond-async`: answer 202 with the status object at once (RFC 7240)")
LAST_EVENT = Query("Last-Event-ID", "resume the event stream after this event id")
LIMIT = Query("limit", "at most this many calls (default 20)", {"type": "integer", "minimum": 1})
TENANT = Query("tenant", "admin keys only: another tenant's calls, or `*` for all")
VERSION = Query("version", "a version number (default: the latest)", {"type": "integer", "minimum": 1})
PARAMS = Query(
    "params", "the parameters as a JSON object (loop counts shape the DAG; default: the workflow's)"
)

OPERATIONS: dict[tuple[str, str], Op] = {
    ("POST", "/v1/images/generations"): Op(
        "Generate images (OpenAI-compatible)",
        description="`model` names a workflow (GET /v1/models). Synchronous unless `Prefer: respond-async`; "
        "answers carry `usage` with the GPU-seconds charged.",
        body=s.ImageGenerationRequest,
        ok=s.ImagesResponse,
        headers=(IDEMPOTENCY, PREFER),
        responses={202: "accepted (`Prefer: respond-async`): the status object", 429: "a limit was reached"},
    ),
    ("POST", "/v1/images/edits"): Op(
        "Edit images (OpenAI-compatible): img2img, inpainting, instruction edits",
        description="`model` names a workflow whose `capabilities` (GET /v1/models) include `edit` "
        "(`inpaint` for a `mask`); a workflow that takes no image gets a 400. Answered, made "
        "asynchronous and followed as generations are.",
        form=s.ImageEditForm,
        ok=s.ImagesResponse,
        headers=(IDEMPOTENCY, PREFER),
        responses={
            202: "accepted (`Prefer: respond-async`): the status object",
            413: "a file over the size limit",
            415: "not a multipart form",
            429: "a limit was reached",
        },
    ),
    ("GET", "/v1/requests"): Op("List recent generation calls", ok=s.RequestList, query=(LIMIT, TENANT)),
    ("GET", "/v1/requests/{id}"): Op("A generation call's status and images", ok=s.RequestStatus),
    ("GET", "/v1/requests/{id}/events"): Op(
        "Follow a generation call (server-sent events)",
        description="`event: node` per finished node (data: the NodeEvent schema), then `event: done` "
        "(data: the RequestStatus schema); `: ping` comments keep the connection open.",
        content_type="text/event-stream",
        headers=(LAST_EVENT,),
    ),
    ("POST", "/v1/requests/{id}/cancel"): Op(
        "Cancel a generation call", description="Answers the call's status object.", ok=s.RequestStatus
    ),
    ("GET", "/v1/images/files/{request_id}/{name}"): Op(
        "A generated image (`response_format: url`)",
        description="`.png` as stored; `.jpeg`, `.jpg` and `.webp` are transcoded.",
        content_type="image/*",
    ),
    ("GET", "/v1/models"): Op("List workflows as OpenAI models", ok=s.ModelList),
    ("GET", "/v1/models/{id}"): Op("A workflow as an OpenAI model", ok=s.Model),
    ("POST", "/v1/workflows"): Op(
        "Register a workflow spec (a new version when it differs)",
        who="admin",
        body=WorkflowSpec,
        ok=s.WorkflowAnswer,
        responses={201: "a new version was stored"},
    ),
    ("GET", "/v1/workflows"): Op("List workflows", ok=s.WorkflowList),
    ("GET", "/v1/workflows/{name}"): Op("A workflow spec", ok=s.WorkflowAnswer, query=(VERSION,)),
    ("GET", "/v1/workflows/{name}/dag"): Op(
        "The workflow unrolled for some parameters: the nodes a request would run",
        ok=s.WorkflowDag,
        query=(PARAMS,),
    ),
    ("POST", "/v1/loras"): Op(
        "Register a LoRA adapter", who="admin", body=s.LoraRegistration, ok=s.LoraAnswer
    ),
    ("GET", "/v1/loras"): Op("List LoRA adapters", ok=s.LoraList),
    ("GET", "/v1/loras/{name}"): Op("A LoRA adapter", ok=s.LoraAnswer),
    ("GET", "/v1/admin/tenants"): Op(
        "Per-tenant vTime, service and queued/running work", who="admin", ok=s.TenantList
    ),
    ("GET", "/v1/admin/tenants/{tenant}/limits"): Op(
        "A tenant's limits, overrides and usage", who="admin", ok=s.TenantLimits
    ),
    ("PUT", "/v1/admin/tenants/{tenant}/limits"): Op(
        "Override a tenant's limits", who="admin", body=s.LimitsOverride, ok=s.TenantLimits
    ),
    ("GET", "/v1/admin/executors"): Op(
        "Executors: their functions, resident models and load", who="admin", ok=s.ExecutorList
    ),
    ("GET", "/healthz"): Op("The process is up", who="public", ok=s.Health),
    ("GET", "/readyz"): Op("NATS is connected and a registry answers", who="public", ok=s.Health),
    ("GET", "/metrics"): Op("Prometheus metrics", who="public", content_type="text/plain"),
    ("GET", "/openapi.json"): Op("This document", who="public", content_type="application/json"),
    ("GET", "/console"): Op(
        "The web console (playground and operator view)", who="public", content_type="text/html"
    ),
    ("GET", "/console/{filename}"): Op("The web console's static files", who="public", content_type="*/*"),
}

# Structs listed in the document even where no operation names them as JSON (SSE payloads).
EXTRA_SCHEMAS: tuple[type, ...] = (s.NodeEvent, s.RequestStatus, s.ErrorResponse)


def route_paths(app: web.Application) -> list[tuple[str, str]]:
    """(method, OpenAPI path) of every route of ``app`` (HEAD folded into GET)."""
    out = []
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        info = route.resource.get_info() if route.resource is not None else {}
        if "prefix" in info:  # a static directory
            path = info["prefix"].rstrip("/") + "/{filename}"
        elif "formatter" in info:
            path = PATH_PARAM.sub(lambda m: "{" + m.group(1) + "}", info["formatter"])
        else:
            path = info.get("path", "")
        out.append((route.method, path))
    return out


def undocumented(app: web.Application) -> list[tuple[str, str]]:
    return [r for r in route_paths(app) if r not in OPERATIONS]


def _operation(method: str, path: str, op: Op | None) -> dict[str, Any]:
    if op is None:
        op = Op("Undocumented route", description="This route has no entry in services/gateway/openapi.py.")
    doc: dict[str, Any] = {
        "summary": op.summary,
        "operationId": re.sub(r"[^A-Za-z0-9]+", "_", f"{method.lower()}{path}").strip("_"),
        "tags": [op.who],
    }
    if op.description:
        doc["description"] = op.description
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in PATH_PARAM.findall(path)
    ]
    params += [
        {"name": q.name, "in": "query", "description": q.description, "schema": q.schema} for q in op.query
    ]
    params += [
        {"name": h.name, "in": "header", "description": h.description, "schema": h.schema} for h in op.headers
    ]
    if params:
        doc["parameters"] = params
    if op.body is not None:
        doc["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(op.body)}}}
    if op.form is not None:
        doc["requestBody"] = {
            "required": True,
            "content": {"multipart/form-data": {"schema": _ref(op.form)}},
        }
    ok: dict[str, Any] = {"description": op.summary}
    if op.ok is not None:
        ok["content"] = {"application/json": {"schema": _ref(op.ok)}}
    elif op.content_type != "application/json":
        ok["content"] = {op.content_type: {"schema": {"type": "string"}}}
    else:
        ok["content"] = {"application/json": {"schema": {"type": "object"}}}
    responses: dict[str, Any] = {str(op.status): ok}
    for status, text in op.responses.items():
        schema = _ref(s.RequestStatus) if status == 202 else _ref(s.ErrorResponse)
        responses[str(status)] = {"description": text, "content": {"application/json": {"schema": schema}}}
    if op.who != "public":
        responses["401"] = _error("missing or unknown API key")
    if op.who == "admin":
        responses["403"] = _error("the key is not an admin's")
    responses["default"] = _error("an error (OpenAI's shape; `x-should-retry` says whether to retry)")
    doc["responses"] = responses
    if op.who == "public":
        doc["security"] = []
    return doc


# What the gateway POSTs to a call's ``webhook`` URL when the call ends (``webhooks.py``).
WEBHOOK: dict[str, Any] = {
    "post": {
        "summary": "A generation call ended",
        "description": "Sent to the call's `webhook` URL; retried with back-off on errors and non-2xx. "
        "`X-T2I-Signature: t=<unix>,v1=<hex>` is HMAC-SHA256 of `<t>.` + the body with the gateway's "
        "webhook secret.",
        "parameters": [
            {"name": "X-T2I-Webhook-Id", "in": "header", "schema": {"type": "string"}},
            {"name": "X-T2I-Signature", "in": "header", "schema": {"type": "string"}},
        ],
        "requestBody": {
            "content": {"application/json": {"schema": {"$ref": REF.format(name="RequestStatus")}}}
        },
        "responses": {"200": {"description": "any 2xx: delivered"}},
    }
}


def _version() -> str:
    try:
        return metadata.version("serverless-t2i")
    except metadata.PackageNotFoundError:
        return "0"


def _ref(t: type) -> dict[str, str]:
    return {"$ref": REF.format(name=t.__name__)}


def _error(text: str) -> dict[str, Any]:
    return {"description": text, "content": {"application/json": {"schema": _ref(s.ErrorResponse)}}}


def build(app: web.Application) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``app``'s routes."""
    paths: dict[str, dict[str, Any]] = {}
    types: list[type] = list(EXTRA_SCHEMAS)
    for method, path in route_paths(app):
        op = OPERATIONS.get((method, path))
        if op is None:
            log.warning("route %s %s has no OpenAPI description", method, path)
        else:
            types += [t for t in (op.body, op.form, op.ok) if t is not None]
        methods = ["get", "put", "post", "delete", "options", "head", "patch", "trace"]
        if method.lower() in methods:
            paths.setdefault(path, {})[method.lower()] = _operation(method, path, op)
    _, components = msgspec.json.schema_components(list(dict.fromkeys(types)), ref_template=REF)
    for op in OPERATIONS.values():  # a form's bytes fields are file parts, not base64 text
        if op.form is not None:
            props = components[op.form.__name__].get("properties", {})
            for prop in props.values():
                for alt in prop.get("anyOf", [prop]):
                    if alt.pop("contentEncoding", None) == "base64":
                        alt["format"] = "binary"
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ServerlessT2I gateway",
            "version": _version(),
            "description": "Serverless multi-tenant text-to-image workflows behind an OpenAI-compatible "
            "API. Errors answer in OpenAI's shape.",
        },
        "servers": [{"url": "/"}],
        "paths": dict(sorted(paths.items())),
        "webhooks": {"generation.done": WEBHOOK},
        "components": {
            "schemas": components,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "an API key"}},
        },
        "security": [{"apiKey": []}],
        "tags": [
            {"name": "public", "description": "no API key needed"},
            {"name": "tenant", "description": "any API key"},
            {"name": "admin", "description": "an admin API key"},
        ],
    }


_built: weakref.WeakKeyDictionary[web.Application, bytes] = weakref.WeakKeyDictionary()


async def openapi_json(request: web.Request) -> web.Response:
    """The document, built once per application (its routes are fixed once it runs)."""
    app = request.app
    body = _built.get(app)
    if body is None:
        body = _built[app] = msgspec.json.encode(build(app))
    return web.Response(body=body, content_type="application/json")
