"""Images over HTTP: ``POST /v1/images/generations``, ``POST /v1/images/edits`` and
``GET /v1/images/files/{request_id}/{name}``.

A generation checks the body, then its :class:`~services.gateway.calls.Call` admits it
(``admission.py``), records it (``records.py``), puts one ``ImageRequest`` per image on the intake
and answers once every image has ended — or at once, 202, with ``Prefer: respond-async`` (RFC 7240;
``Location: /v1/requests/{id}``). The waiting runs in a task of its own that holds the call's
admission slots until the images are done. A synchronous call whose client disconnects is
cancelled, unless it carries an ``Idempotency-Key`` (its client will retry and pick it up:
``idempotency.py``); a ``webhook`` in the body is called when the call ends (``webhooks.py``).

An edit is the same call from a multipart form (``edits.py``): its files fill the workflow's
``image`` (and ``mask``) parameters, and it is answered, made asynchronous, followed over SSE and
looked up exactly as a generation is.

An image of a call made with ``response_format: url`` is fetched from the file route by the tenant
that made it: ``.png`` as stored, ``.jpeg``/``.webp`` transcoded (``formats.py``).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from aiohttp import web

from libs.protocol.ids import generation_of, image_object
from libs.protocol.messages import ImageRef
from services.gateway import webhooks
from services.gateway.auth import Principal
from services.gateway.body import BUS_PAYLOAD_LIMIT, json_object, read_json, too_large
from services.gateway.bridge import Bridge
from services.gateway.calls import REQUEST_ID_HEADER, Call
from services.gateway.context import BRIDGE, CONFIG, DECODE_SLOTS, METRICS, PRINCIPAL, RECORDS
from services.gateway.edits import EditForm, bind_files, read_edit_form
from services.gateway.errors import ApiError
from services.gateway.formats import CONTENT_TYPES, DEFAULT_COMPRESSION, suffix_format, transcode
from services.gateway.generation import parse_generation, parse_model
from services.gateway.idempotency import idempotency_key
from services.gateway.models import lookup_workflow
from services.gateway.routes import disconnected

log = logging.getLogger(__name__)

PREFER_ASYNC = re.compile(r"(?:^|,)\s*respond-async\s*(?:[;,]|$)", re.IGNORECASE)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/images/generations", generate)
    router.add_post("/v1/images/edits", edit)
    router.add_get("/v1/images/files/{request_id}/{name}", image_file)


def wants_async(request: web.Request) -> bool:
    """Whether the call asked to be answered at once (RFC 7240 ``Prefer: respond-async``)."""
    return any(PREFER_ASYNC.search(v) for v in request.headers.getall("Prefer", []))


# -- POST /v1/images/generations ---------------------------------------------------------------------
async def generate(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    body = json_object(await read_json(request, int(cfg.max_body_mb * (1 << 20))))
    return await _call(request, body, webhook=True)


# -- POST /v1/images/edits --------------------------------------------------------------------------
async def edit(request: web.Request) -> web.Response:
    form = await read_edit_form(request)
    return await _call(request, form.body, form=form)


async def _call(
    request: web.Request, body: dict[str, Any], *, webhook: bool = False, form: EditForm | None = None
) -> web.Response:
    """A generation (or an edit, with its ``form``'s files) checked, made into a call and answered."""
    app = request.app
    cfg = app[CONFIG]
    who: Principal = request[PRINCIPAL]
    key = idempotency_key(request)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and len(prompt.encode()) > BUS_PAYLOAD_LIMIT:
        raise too_large("prompt", BUS_PAYLOAD_LIMIT, param="prompt")
    spec = await lookup_workflow(app[BRIDGE], parse_model(body))
    if form is not None:
        bind_files(form, spec)
    respond_async = wants_async(request)
    hook = webhooks.check_url(body["webhook"]) if webhook and "webhook" in body else None
    gen = parse_generation({k: v for k, v in body.items() if k != "webhook"}, spec, cfg.max_n)
    files = form.files if form is not None else None
    call = await Call.create(app, who.tenant, spec, gen, body, key, files)
    if call.replayed:  # the call this key names: answer as it answers
        data = await call.replay(request, respond_async)
        return accepted(call, data) if respond_async else answered(call, data)
    call.submit(request, hook)
    if respond_async:
        return accepted(call, await call.status(request, with_data=False))
    t0 = time.monotonic()
    # A client that hangs up cancels the call, unless it sent an Idempotency-Key (it will retry and
    # pick the call up); the task keeps the call's slots until its images have ended either way.
    results = await call.wait(gone=None if key else lambda: disconnected(request))
    if results is None:
        return client_gone()
    response = answered(call, await call.answer(request, results, stale=False))
    app[METRICS]["images_generated"] += gen.n
    log.info(
        "%s: %d image(s) of %s for %s in %.2fs", call.id, gen.n, spec.name, who.tenant, time.monotonic() - t0
    )
    return response


def answered(call: Call, body: dict[str, Any]) -> web.Response:
    """A call's answer; it carries ``x-request-id``, so the call can be looked up later."""
    return web.json_response(body, headers={REQUEST_ID_HEADER: call.id})


def accepted(call: Call, status: dict[str, Any]) -> web.Response:
    """The 202 answer of an asynchronous call: where to find it, and its status now."""
    headers = {
        "Location": f"/v1/requests/{call.id}",
        "Preference-Applied": "respond-async",
        REQUEST_ID_HEADER: call.id,
    }
    return web.json_response(status, status=202, headers=headers)


def client_gone() -> web.Response:
    """What a call whose client went away answers (to no one; nginx's 499 in the access log)."""
    return web.Response(status=499, reason="Client Closed Request")


# -- GET /v1/images/files/{request_id}/{name} ------------------------------------------------------------
async def image_file(request: web.Request) -> web.Response:
    rid, name = request.match_info["request_id"], request.match_info["name"]
    bridge: Bridge = request.app[BRIDGE]
    missing = ApiError(404, f"no image {rid[:64]}/{name[:64]}", code="not_found")
    fmt = suffix_format(name)  # the file is stored as PNG; .jpeg/.jpg/.webp are transcoded
    if fmt is None or "/" in rid or not rid:
        raise missing
    owner = await bridge.request_tenant(rid)
    if owner is None or owner != request[PRINCIPAL].tenant:
        raise missing
    try:
        obj = image_object(rid, name.rpartition(".")[0])
    except ValueError:
        raise missing from None
    png = await bridge.fetch_image(ImageRef(bucket="", name=obj, nbytes=0, width=0, height=0), delete=False)
    if png is None:
        raise ApiError(404, f"image {rid[:64]}/{name[:64]} has expired or does not exist", code="not_found")
    compression = DEFAULT_COMPRESSION
    if fmt != "png":  # as the call asked, when it asked for this format
        rec = await request.app[RECORDS].load(generation_of(rid))
        if rec is not None and rec.output_format == fmt:
            compression = rec.output_compression
    body = await transcode(png, fmt, compression, request.app[DECODE_SLOTS])
    return web.Response(body=body, content_type=CONTENT_TYPES[fmt])
