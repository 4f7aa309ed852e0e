"""Calls as jobs: answered at once (``Prefer: respond-async``), followed, cancelled, called back.

A generation call normally answers when its images are done (``images.generate``). This module
adds what a client that does not want to wait on one connection needs:

| route | what |
|---|---|
| ``POST /v1/images/generations`` + ``Prefer: respond-async`` | 202 at once with the status object, ``Location: /v1/requests/{id}`` |
| ``GET /v1/requests/{id}`` | the status object (progress over nodes and denoising steps; ``data`` once succeeded) |
| ``GET /v1/requests/{id}/events`` | the same as server-sent events: one ``node`` event per finished node, then ``done`` |
| ``POST /v1/requests/{id}/cancel`` | cancels the call's image requests at the scheduler; answers the status object |
| ``GET /v1/requests`` | the tenant's recent calls, newest first (admins: ``?tenant=<t>`` or ``*``) |
| ``GET /v1/admin/executors`` | the scheduler's view of its executors: what each runs and has resident |

A synchronous call is cancelled when its client disconnects (aiohttp does not cancel handlers when
a connection drops, so :func:`wait_attached` watches the transport) — unless it carries an
``Idempotency-Key``: such a client has said it will retry, and its retry picks the call up.

Progress and events come from the scheduler: for every node it finishes it appends an event to the
Redis stream ``{ns}:events:{request_id}`` and keeps ``nodes_done``/``nodes_total``/``step``/``steps``
current in ``{ns}:req:{request_id}``; a last ``end`` entry closes the stream. The event ids the
gateway sends are cursors over the call's streams (``0:1733-0,1:1740-2``: image index, entry id),
so a client that reconnects with ``Last-Event-ID`` resumes where it was.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from libs.protocol.messages import RequestResult
from services.gateway.auth import TENANT
from services.gateway.bridge import Bridge
from services.gateway.calls import result_items
from services.gateway.context import BRIDGE, CONFIG, PRINCIPAL, RECORDS, TASKS
from services.gateway.errors import ApiError
from services.gateway.records import GenerationRecord
from services.gateway.results import call_status, error_of, usage_of
from services.gateway.webhooks import Webhooks

log = logging.getLogger(__name__)

WEBHOOKS = web.AppKey("webhooks", Webhooks)

PREFER_ASYNC = re.compile(r"(?:^|,)\s*respond-async\s*(?:[;,]|$)", re.IGNORECASE)
GENERATION_ID = re.compile(r"^[0-9a-f]{20}$")
CURSOR = re.compile(r"^[0-9]{1,2}:[0-9]{1,20}-[0-9]{1,20}$")
DISCONNECT_POLL_S = 0.25  # how often a synchronous call looks at its connection
SUBMIT_WAIT_S = 2.0  # a cancel waits this long for an image of the call to be submitted
CANCEL_WAIT_S = 5.0  # a cancel answers once its images ended, or after this long
EVENT_BLOCK_MS = 1000  # one XREAD; between reads the stream checks whether the call ended
HEARTBEAT_S = 15.0
EVENTS_PER_READ = 256
MAX_RECENT = 100


# -- Prefer: respond-async ------------------------------------------------------------------------------
def wants_async(request: web.Request) -> bool:
    """Whether the call asked to be answered at once (RFC 7240 ``Prefer: respond-async``)."""
    return any(PREFER_ASYNC.search(v) for v in request.headers.getall("Prefer", []))


async def accepted(request: web.Request, rec: GenerationRecord) -> web.Response:
    """The 202 answer of an asynchronous call: where to find it, and its status now."""
    body = await status_object(request, rec, with_data=False)
    headers = {
        "Location": f"/v1/requests/{rec.id}",
        "Preference-Applied": "respond-async",
        "x-request-id": rec.id,
    }
    return web.json_response(body, status=202, headers=headers)


# -- the status object ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Origin:
    """What building a call's ``data`` needs of the request that made it (image URLs are on its
    host), kept so a webhook sent after that request is gone builds the same URLs."""

    app: web.Application
    scheme: str
    host: str


async def status_object(
    origin: web.Request | Origin, rec: GenerationRecord, with_data: bool = True
) -> dict[str, Any]:
    """The call as ``GET /v1/requests/{id}`` shows it (also the 202 body, the SSE ``done`` event
    and the webhook body)."""
    bridge = origin.app[BRIDGE]
    states, progress = await asyncio.gather(bridge.states(rec.request_ids), _progress(bridge, rec))
    status = call_status(states)
    results = [s.result for s in states]
    out: dict[str, Any] = {
        "id": rec.id,
        "object": "image.generation.request",
        "created": rec.created,
        "model": rec.model,
        "status": status,
        "n": rec.n,
        "completed": sum(r is not None for r in results),
        "progress": progress,
        "usage": usage_of(results),
    }
    if status == "succeeded" and with_data:
        out["data"] = await result_items(origin, rec, results, stale=True)  # type: ignore[arg-type]
    elif status in ("failed", "cancelled"):
        rid, ended = next((r, s) for r, s in zip(rec.request_ids, states, strict=True) if s.status == status)
        err = error_of(ended.result, rid, rec.timeout_s, rec.loras)
        out["error"] = {**err.body(), "status": err.status}
    return out


async def _progress(bridge: Bridge, rec: GenerationRecord) -> dict[str, int]:
    """Nodes done and denoising steps finished over the call's images (the scheduler keeps them in
    each request's hash)."""
    names = ("nodes_done", "nodes_total", "step", "steps")
    pipe = bridge.redis.pipeline(transaction=False)
    for rid in rec.request_ids:
        pipe.hmget(bridge.keys.request(rid), *names)
    total = dict.fromkeys(names, 0)
    for values in await pipe.execute():
        for name, raw in zip(names, values, strict=True):
            try:
                total[name] += int(float(raw)) if raw else 0
            except ValueError:
                continue
    return total


async def own_call(request: web.Request, admin_reads: bool = False) -> GenerationRecord:
    """The call ``{id}`` names, if the caller's tenant made it (or, with ``admin_reads``, the caller
    is an admin: the operator view reads any tenant's calls); else 404 (as if it did not exist)."""
    gen_id = request.match_info["id"]
    rec = await request.app[RECORDS].load(gen_id) if GENERATION_ID.match(gen_id) else None
    who = request[PRINCIPAL]
    if rec is None or (rec.tenant != who.tenant and not (admin_reads and who.admin)):
        raise ApiError(404, f"no request {gen_id[:64]!r}", param="id", code="not_found")
    return rec


async def get_request(request: web.Request) -> web.Response:
    return web.json_response(await status_object(request, await own_call(request, admin_reads=True)))


# -- cancelling -------------------------------------------------------------------------------------------
async def cancel_images(bridge: Bridge, rec: GenerationRecord, request_ids: list[str], reason: str) -> None:
    """Ask the scheduler to cancel these image requests of ``rec`` (idempotent there; an image
    that has ended meanwhile is left as it ended)."""
    cancel = getattr(bridge, "cancel", None)
    if cancel is None:  # a scheduler bridge without cancellation
        raise ApiError(501, "cancelling is not supported by this gateway", code="not_supported")

    async def one(rid: str) -> None:
        # A call cancelled right after it was accepted may not have submitted this image yet (its
        # task does that): until the request exists there is nothing to flag, so look again.
        deadline = time.monotonic() + SUBMIT_WAIT_S
        while not await cancel(rid, rec.tenant, reason):
            if await bridge.request_tenant(rid) is not None or time.monotonic() > deadline:
                return  # it exists, so it ended (or is not the tenant's): nothing to cancel
            await asyncio.sleep(0.05)

    await asyncio.gather(*(one(rid) for rid in request_ids))


async def cancel_call(request: web.Request) -> web.Response:
    """``POST /v1/requests/{id}/cancel``: cancels what has not ended, waits a little for it to end
    (a running image ends once its executors stopped), and answers the status object."""
    rec = await own_call(request)
    bridge = request.app[BRIDGE]
    states = await bridge.states(rec.request_ids)
    pending = [rid for rid, s in zip(rec.request_ids, states, strict=True) if s.result is None]
    if pending:
        futures = {rid: bridge.expect(rid) for rid in pending}  # before cancelling: not missed
        try:
            await cancel_images(bridge, rec, pending, "cancelled by the tenant")
        except BaseException:
            for rid, fut in futures.items():
                bridge.forget(rid, fut)
            raise
        log.info("%s: cancelling %d image request(s) for %s", rec.id, len(pending), rec.tenant)
        await asyncio.gather(*(bridge.wait(rid, CANCEL_WAIT_S, futures[rid]) for rid in pending))
    return web.json_response(await status_object(request, rec))


def disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def wait_attached(
    request: web.Request, task: asyncio.Task[list[RequestResult | None]], rec: GenerationRecord, cancel: bool
) -> list[RequestResult | None] | None:
    """The results of a synchronous call's task; None when its client went away (the call is
    cancelled then: answer :func:`client_gone`).

    The task is never cancelled from here (it holds the call's admission slots until its images
    have ended, cancelled or not); with ``cancel`` false a client that hangs up leaves it running.
    """
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if cancel and disconnected(request):
            log.info("%s: the client disconnected; cancelling the call", rec.id)
            try:
                await cancel_images(request.app[BRIDGE], rec, rec.request_ids, "the client disconnected")
            except (ApiError, RedisError, OSError) as e:
                log.warning("%s: cancelling after a disconnect failed: %s", rec.id, e)
            return None


def client_gone() -> web.Response:
    """What a call whose client went away answers (to no one; nginx's 499 in the access log)."""
    return web.Response(status=499, reason="Client Closed Request")


# -- events -----------------------------------------------------------------------------------------------
def parse_cursor(header: str | None, n: int) -> list[str]:
    """Each image's last stream entry seen, from a ``Last-Event-ID`` (``i:entry,...``)."""
    cursor = ["0-0"] * n
    if not header:
        return cursor
    if len(header) > 64 * n + 64:
        raise _bad_cursor()
    for part in header.split(","):
        if not CURSOR.match(part):
            raise _bad_cursor()
        index, _, entry = part.partition(":")
        if int(index) >= n:
            raise _bad_cursor()
        cursor[int(index)] = entry
    return cursor


def _bad_cursor() -> ApiError:
    return ApiError(
        422,
        "Last-Event-ID: not an event id of this request's stream",
        param="Last-Event-ID",
        code="invalid_value",
    )


def format_cursor(cursor: list[str]) -> str:
    return ",".join(f"{i}:{entry}" for i, entry in enumerate(cursor) if entry != "0-0")


async def read_events(
    bridge: Bridge, rec: GenerationRecord, cursor: list[str], block_ms: int
) -> list[tuple[int, str, dict[str, Any]]]:
    """The next entries of the call's streams after ``cursor``: (image index, entry id, event)."""
    index = {rid: i for i, rid in enumerate(rec.request_ids)}
    after = {rid: cursor[i] for rid, i in index.items()}
    return [
        # A malformed entry still moves the cursor, so it is not read again.
        (index[rid], entry, event if event is not None else {"type": "invalid"})
        for rid, entry, event in await bridge.read_events(after, block_ms, EVENTS_PER_READ)
    ]


def sse(event: str | None, data: object | None = None, event_id: str | None = None) -> bytes:
    lines = []
    if event_id:
        lines.append(f"id: {event_id}")
    if event:
        lines.append(f"event: {event}")
    if data is not None:
        lines.append("data: " + msgspec.json.encode(data).decode())
    return ("\n".join(lines) + "\n\n").encode()


async def events(request: web.Request) -> web.StreamResponse:
    """``GET /v1/requests/{id}/events``: ``node`` events in order, then ``done``; then closes."""
    rec = await own_call(request, admin_reads=True)
    cursor = parse_cursor(request.headers.get("Last-Event-ID"), rec.n)
    bridge = request.app[BRIDGE]
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies: do not buffer the stream
            "x-request-id": rec.id,
        }
    )
    await resp.prepare(request)
    ended = [False] * rec.n
    give_up = rec.created + rec.timeout_s + 60  # the call answered 504 by then
    last_write = time.monotonic()
    try:
        async for batch in _batches(bridge, rec, cursor):
            for i, entry, event in batch:
                cursor[i] = entry
                if event.get("type") == "end":
                    ended[i] = True
                elif event.get("type") == "node":
                    await resp.write(sse("node", {**event, "image": i}, format_cursor(cursor)))
                    last_write = time.monotonic()
            # Done once every image has ended: its ``end`` entry read, or (a stream trimmed, or a
            # result the scheduler gave without one) nothing more to read and its result stored.
            if (all(ended) or not batch) and (await _all_ended(bridge, rec) or time.time() > give_up):
                done = await status_object(request, rec)
                await resp.write(sse("done", done, format_cursor(cursor) or None))
                break
            if time.monotonic() - last_write >= HEARTBEAT_S:
                await resp.write(b": ping\n\n")
                last_write = time.monotonic()
            if disconnected(request):
                break
    except (ConnectionResetError, ConnectionError):  # the client went away: nothing to tell it
        return resp
    except RedisError as e:  # headers are sent: end the stream; the client reconnects with its id
        log.warning("the event stream of %s ended: Redis is unavailable: %s", rec.id, e)
        return resp
    await resp.write_eof()
    return resp


async def _batches(
    bridge: Bridge, rec: GenerationRecord, cursor: list[str]
) -> AsyncIterator[list[tuple[int, str, dict[str, Any]]]]:
    while True:
        yield await read_events(bridge, rec, cursor, EVENT_BLOCK_MS)


async def _all_ended(bridge: Bridge, rec: GenerationRecord) -> bool:
    return all(s.result is not None for s in await bridge.states(rec.request_ids))


# -- lists ------------------------------------------------------------------------------------------------
async def list_requests(request: web.Request) -> web.Response:
    """``GET /v1/requests?limit=20``: the tenant's recent calls, newest first, without images."""
    who = request[PRINCIPAL]
    raw_limit = request.query.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_RECENT:
        raise ApiError(
            422, f"limit: must be an integer from 1 to {MAX_RECENT}", param="limit", code="invalid_value"
        )
    tenant: str | None = who.tenant
    if "tenant" in request.query:
        if not who.admin:
            raise ApiError(403, "listing another tenant's requests needs an admin API key", code="forbidden")
        asked = request.query["tenant"]
        if asked != "*" and not TENANT.match(asked):
            raise ApiError(422, "tenant: not a tenant name (or '*')", param="tenant", code="invalid_value")
        tenant = None if asked == "*" else asked
    recs = await request.app[RECORDS].recent(tenant, int(raw_limit))
    data = await asyncio.gather(*(status_object(request, r, with_data=False) for r in recs))
    for rec, item in zip(recs, data, strict=True):
        if tenant is None or tenant != who.tenant:
            item["tenant"] = rec.tenant
    return web.json_response({"object": "list", "data": list(data)})


async def admin_executors(request: web.Request) -> web.Response:
    """``GET /v1/admin/executors``: each executor's ModelFns, resident models and load, as the
    scheduler last wrote them (refreshed about every second)."""
    if not request[PRINCIPAL].admin:
        raise ApiError(403, "the executor view needs an admin API key", code="forbidden")
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


# -- webhooks ---------------------------------------------------------------------------------------------
def follow(request: web.Request, rec: GenerationRecord, webhook: str | None, task: asyncio.Task) -> None:
    """Once the call's task ends, deliver its final status to ``webhook`` (if it has one)."""
    if not webhook:
        return
    app = request.app
    origin = Origin(app, request.scheme, request.host)

    def on_done(t: asyncio.Task) -> None:
        if t.cancelled() or t.exception() is not None:  # shutting down, or nothing was submitted
            return

        async def body() -> bytes:
            return msgspec.json.encode(await status_object(origin, rec))

        delivery = asyncio.create_task(app[WEBHOOKS].deliver(webhook, rec.id, body))
        app[TASKS].add(delivery)
        delivery.add_done_callback(app[TASKS].discard)

    task.add_done_callback(on_done)


async def jobs_ctx(app: web.Application) -> AsyncIterator[None]:
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
