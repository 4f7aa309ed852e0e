"""Workflows over HTTP: registered by admins (``POST /v1/workflows``, versioned by the registry),
listed and looked up by everyone, and unrolled for the console's drawing
(``GET /v1/workflows/{name}/dag``)."""

from __future__ import annotations

import json
import re

import msgspec
from aiohttp import web

from libs.common.registry_client import WorkflowNotFound
from libs.workflow.dag import workflow_dag
from libs.workflow.errors import ParamError
from libs.workflow.spec import encode_spec
from services.gateway import models
from services.gateway.body import BUS_PAYLOAD_LIMIT, json_object, read_json
from services.gateway.context import BRIDGE, PRINCIPAL
from services.gateway.errors import ApiError
from services.gateway.routes import require_admin

VERSION = re.compile(r"^[0-9]{1,9}$")
#: A DAG the console may ask for: beyond this many nodes the drawing is not readable anyway.
MAX_DAG_NODES = 2000


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/workflows", register_workflow)
    router.add_get("/v1/workflows", list_workflows)
    router.add_get("/v1/workflows/{name}", get_workflow)
    router.add_get("/v1/workflows/{name}/dag", get_workflow_dag)


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
    spec = await models.lookup_workflow(request.app[BRIDGE], name, param="name")
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
