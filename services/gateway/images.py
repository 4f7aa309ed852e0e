"""Image generation over HTTP: the synchronous call, its idempotent retries, and looking a call up.

``POST /v1/images/generations`` checks the body, admits the call (``admission.py``), records it
(``records.py``), puts one ``ImageRequest`` per image on the intake and answers once every image
has ended — or at once, 202, with ``Prefer: respond-async`` (``jobs.py``). The waiting runs in a
task of its own that holds the call's admission slots until the images are done. A synchronous
call whose client disconnects is cancelled, unless it carries an ``Idempotency-Key`` (its client
will retry and pick it up); a ``webhook`` in the body is called when the call ends (``webhooks.py``).

With an ``Idempotency-Key`` header the same tenant and key within 24 h name one call: a repeat
with the same body waits for and returns that call's answer and submits nothing; a repeat with a
different body is refused (422, ``param: Idempotency-Key``).

``GET /v1/requests/{id}`` reports a call by the ``id`` its answer carries: ``queued``, ``running``,
``succeeded`` (with ``data`` as the call answered it), ``failed`` or ``cancelled`` (with ``error``),
with its progress (``jobs.status_object``). Only the tenant that made the call may read it; for
anyone else it does not exist (404, never 403).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from libs.common.logs import bind_request
from libs.common.registry_client import WorkflowNotFound
from libs.protocol.ids import generation_of, image_object
from libs.protocol.messages import ImageRef, ImageRequest, RequestResult, encode
from libs.workflow.spec import WorkflowSpec
from libs.workflow.validate import WORKFLOW_NAME
from services.gateway import jobs, webhooks
from services.gateway.auth import Principal
from services.gateway.body import BUS_PAYLOAD_LIMIT, json_object, read_json, too_large
from services.gateway.bridge import Bridge
from services.gateway.calls import result_items
from services.gateway.context import (
    ADMISSION,
    BRIDGE,
    CONFIG,
    DECODE_SLOTS,
    KEY_TURNS,
    LIMITS,
    METRICS,
    PRINCIPAL,
    PROM,
    RECORDS,
    TASKS,
)
from services.gateway.errors import ApiError
from services.gateway.formats import CONTENT_TYPES, DEFAULT_COMPRESSION, suffix_format, transcode
from services.gateway.generation import Generation, parse_generation, parse_model
from services.gateway.inputs import resolve_inputs
from services.gateway.records import GenerationRecord, IdempotencyRecord, fingerprint
from services.gateway.results import error_of, usage_of

log = logging.getLogger(__name__)

IDEMPOTENCY_HEADER = "Idempotency-Key"
REQUEST_ID_HEADER = "x-request-id"
IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII, no spaces
GENERATION_ID = re.compile(r"^[0-9a-f]{20}$")


async def lookup_workflow(bridge: Bridge, name: str, param: str = "model") -> WorkflowSpec:
    try:
        if not WORKFLOW_NAME.match(name):  # cannot exist; and a long name would not fit on the bus
            raise WorkflowNotFound(name[:64])
        return await bridge.registry.get(name)
    except WorkflowNotFound:
        name = name if len(name) <= 64 else name[:64] + "..."
        raise ApiError(
            404, f"{param}: workflow {name!r} not found", param=param, code="model_not_found"
        ) from None


def idempotency_key(request: web.Request) -> str | None:
    values = request.headers.getall(IDEMPOTENCY_HEADER, [])
    if not values:
        return None
    if len(values) > 1 or not IDEMPOTENCY_KEY.match(values[0]):
        raise ApiError(
            422,
            f"{IDEMPOTENCY_HEADER}: must be one value of 1 to 255 printable ASCII characters",
            param=IDEMPOTENCY_HEADER,
            code="invalid_value",
        )
    return values[0]


# -- POST /v1/images/generations ---------------------------------------------------------------------
async def generate(request: web.Request) -> web.Response:
    app = request.app
    cfg, bridge, records = app[CONFIG], app[BRIDGE], app[RECORDS]
    who: Principal = request[PRINCIPAL]
    key = idempotency_key(request)
    body = json_object(await read_json(request, int(cfg.max_body_mb * (1 << 20))))
    prompt = body.get("prompt")
    if isinstance(prompt, str) and len(prompt.encode()) > BUS_PAYLOAD_LIMIT:
        raise too_large("prompt", BUS_PAYLOAD_LIMIT, param="prompt")
    spec = await lookup_workflow(bridge, parse_model(body))
    respond_async = jobs.wants_async(request)
    webhook = webhooks.check_url(body["webhook"]) if "webhook" in body else None
    gen = parse_generation({k: v for k, v in body.items() if k != "webhook"}, spec, cfg.max_n)
    fp = fingerprint(body) if key else ""
    # Calls with one key in this process take turns until the first has claimed it, so a repeat
    # waits for that call instead of taking admission slots of its own (and a 429 at the limit).
    async with key_turn(app, who.tenant, key):
        held = await records.held(who.tenant, key) if key else None
        started = held if held is not None else await _start(request, spec, gen, body, key, fp)
    if isinstance(started, IdempotencyRecord):  # the call this key names: answer as it answers
        return await replay(request, started, fp, respond_async)
    rec, task = started
    app[TASKS].add(task)
    task.add_done_callback(lambda t: _task_done(app, t))
    jobs.follow(request, rec, webhook, task)
    if respond_async:
        return await jobs.accepted(request, rec)
    t0 = time.monotonic()
    # A client that hangs up cancels the call, unless it sent an Idempotency-Key (it will retry and
    # pick the call up); the task keeps the call's slots until its images have ended either way.
    results = await jobs.wait_attached(request, task, rec, cancel=key is None)
    if results is None:
        return jobs.client_gone()
    response = await answer(request, rec, results, stale=False)
    app[METRICS]["images_generated"] += gen.n
    log.info(
        "%s: %d image(s) of %s for %s in %.2fs", rec.id, gen.n, spec.name, who.tenant, time.monotonic() - t0
    )
    return response


@contextlib.asynccontextmanager
async def key_turn(app: web.Application, tenant: str, key: str | None) -> AsyncIterator[None]:
    """Hold this process's turn for ``(tenant, key)`` (nothing without a key)."""
    if key is None:
        yield
        return
    turns: dict[tuple[str, str], asyncio.Lock] = app[KEY_TURNS]
    lock = turns.setdefault((tenant, key), asyncio.Lock())
    try:
        async with lock:
            yield
    finally:
        if not lock.locked() and turns.get((tenant, key)) is lock:
            del turns[(tenant, key)]


async def _start(
    request: web.Request, spec: WorkflowSpec, gen: Generation, body: dict[str, Any], key: str | None, fp: str
) -> tuple[GenerationRecord, asyncio.Task[list[RequestResult | None]]] | IdempotencyRecord:
    """Admit, record and submit a new call; or, when a call elsewhere claimed ``key`` first, its
    idempotency record (this call's own record dropped, nothing submitted)."""
    app = request.app
    cfg, bridge, records = app[CONFIG], app[BRIDGE], app[RECORDS]
    who: Principal = request[PRINCIPAL]

    # Admitted before any heavy work (decoding control images): a tenant at its limit costs nothing.
    # The platform-wide limits (queued, GPU-second quota; limits.py) first, then this process's.
    await app[LIMITS].check(who.tenant, gen.n)
    admission = app[ADMISSION]
    admission.admit(who.tenant, gen.n)
    app[LIMITS].admitted(who.tenant, gen.n)
    gen_id = uuid.uuid4().hex[:20]
    bind_request(gen_id)  # this handler's and its tasks' log lines carry the call id
    task: asyncio.Task[list[RequestResult | None]] | None = None
    claim = IdempotencyRecord(gen_id, fp) if key else None
    first: IdempotencyRecord | None = None
    try:
        loras = await resolve_inputs(spec, gen.params, body, bridge, gen_id, app[DECODE_SLOTS])
        rec = GenerationRecord(
            id=gen_id,
            tenant=who.tenant,
            model=spec.name,
            created=int(time.time()),
            n=gen.n,
            response_format=gen.response_format,
            seeds=gen.seeds,
            timeout_s=cfg.request_timeout_s,
            loras=loras,
            output_format=gen.output_format,
            output_compression=gen.output_compression,
            size=gen.size,
        )
        reqs = _image_requests(rec, spec, gen)
        await records.save(rec)
        if key and claim:
            first = await records.claim(who.tenant, key, claim)  # not None: another call got there first
        if first is None:
            task = asyncio.create_task(_submit_and_wait(app, rec, reqs, key, claim))
    finally:
        if task is None:  # the task frees the slots it was given; nothing else took them
            admission.release(who.tenant, gen.n)
    if first is not None:
        await records.drop(gen_id, who.tenant)
        return first
    assert task is not None
    return rec, task


def _task_done(app: web.Application, task: asyncio.Task) -> None:
    app[TASKS].discard(task)
    if not task.cancelled() and task.exception() is not None:  # its call may have hung up: log it here
        log.warning("a generation failed: %r", task.exception())


def _image_requests(rec: GenerationRecord, spec: WorkflowSpec, gen: Generation) -> list[ImageRequest]:
    reqs = []
    now = time.time()
    for rid, params in zip(rec.request_ids, gen.params, strict=True):
        req = ImageRequest(
            request_id=rid,
            tenant=rec.tenant,
            workflow=spec.name,
            version=spec.version,
            params=params,
            submitted_at=now,
            timeout_s=rec.timeout_s,
        )
        if len(encode(req)) > BUS_PAYLOAD_LIMIT:
            raise too_large("the prompt and parameters of one image", BUS_PAYLOAD_LIMIT, param="params")
        reqs.append(req)
    return reqs


async def _submit_and_wait(
    app: web.Application,
    rec: GenerationRecord,
    reqs: list[ImageRequest],
    key: str | None,
    claim: IdempotencyRecord | None,
) -> list[RequestResult | None]:
    """Submit the call's images and wait for them; the call's admission slots are freed at the end."""
    bridge, records = app[BRIDGE], app[RECORDS]
    futures = [bridge.expect(r.request_id) for r in reqs]
    try:
        submitted = 0
        try:
            for req in reqs:
                await bridge.submit(req)
                submitted += 1
        except BaseException:
            if submitted == 0:  # nothing reached the scheduler: the key and the record are void
                if key and claim:
                    await records.release(rec.tenant, key, claim)
                await records.drop(rec.id, rec.tenant)
            raise
        app[METRICS]["images_requested"] += rec.n
        results = await asyncio.gather(
            *(bridge.wait(r.request_id, rec.timeout_s + 5, f) for r, f in zip(reqs, futures, strict=True))
        )
        await bridge.remember([r for r in results if r is not None])
        app[PROM].call_ended(rec.model, rec.tenant, results, time.time() - reqs[0].submitted_at)
        if key and claim and any(r is not None and r.error_code == "rate_limited" for r in results):
            # Answered 429 (worth retrying): a retry with the same key must be a new call, not
            # this answer again.
            await records.release(rec.tenant, key, claim)
        return list(results)
    finally:
        for r, f in zip(reqs, futures, strict=True):
            bridge.forget(r.request_id, f)
        app[ADMISSION].release(rec.tenant, rec.n)


async def replay(
    request: web.Request, held: IdempotencyRecord, fp: str, respond_async: bool = False
) -> web.Response:
    """The answer of the call an idempotency key names, waiting for it if it is still running
    (or its status at once, 202, for ``Prefer: respond-async``)."""
    if held.fingerprint != fp:
        raise ApiError(
            422,
            f"{IDEMPOTENCY_HEADER}: this key was used with a different request body in the last 24 h",
            param=IDEMPOTENCY_HEADER,
            code="idempotency_mismatch",
        )
    app = request.app
    rec = await app[RECORDS].load(held.generation_id)
    if rec is None or rec.tenant != request[PRINCIPAL].tenant:
        raise ApiError(
            409, f"the call of this {IDEMPOTENCY_HEADER} is being set up; retry", code="idempotency_conflict"
        )
    if respond_async:
        app[METRICS]["idempotent_replays"] += 1
        return await jobs.accepted(request, rec)
    bridge = app[BRIDGE]
    left = max(1.0, rec.created + rec.timeout_s + 5 - time.time())
    results = await asyncio.gather(*(bridge.wait(rid, left) for rid in rec.request_ids))
    # Kept as the first call's are: a lookup by id must then agree with this answer, even before the
    # scheduler has stored the results (it publishes them first).
    await bridge.remember([r for r in results if r is not None])
    app[METRICS]["idempotent_replays"] += 1
    return await answer(request, rec, list(results), stale=True)


async def answer(
    request: web.Request, rec: GenerationRecord, results: list[RequestResult | None], stale: bool
) -> web.Response:
    """The response of a call: its images, or the error of its first image that has none.

    Either way it carries ``x-request-id``: a call that failed or timed out can be looked up later.
    """
    try:
        for rid, result in zip(rec.request_ids, results, strict=True):
            if result is None or result.status != "succeeded" or not result.images:
                raise error_of(result, rid, rec.timeout_s, rec.loras)
        data = await result_items(request, rec, results, stale)  # type: ignore[arg-type]
    except ApiError as e:
        e.headers[REQUEST_ID_HEADER] = rec.id
        raise
    body = {
        "id": rec.id,
        "created": rec.created,
        "model": rec.model,
        "data": data,
        "output_format": rec.output_format,
        "usage": usage_of(list(results)),
    }
    if rec.size:
        body["size"] = rec.size
    return web.json_response(body, headers={REQUEST_ID_HEADER: rec.id})


# -- GET /v1/requests/{id} ------------------------------------------------------------------------------
async def get_request(request: web.Request) -> web.Response:
    """The call's status object (``jobs.status_object``): progress, and ``data`` once succeeded."""
    return await jobs.get_request(request)


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
