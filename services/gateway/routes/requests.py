"""Generation calls as jobs: looked up, followed, cancelled, listed (``/v1/requests``).

| route | what |
|---|---|
| ``GET /v1/requests/{id}`` | the status object (progress over nodes and denoising steps; ``data`` once succeeded) |
| ``GET /v1/requests/{id}/events`` | the same as server-sent events: one ``node`` event per finished node, then ``done`` |
| ``POST /v1/requests/{id}/cancel`` | cancels the call's image requests at the scheduler; answers the status object |
| ``GET /v1/requests`` | the tenant's recent calls, newest first (admins: ``?tenant=<t>`` or ``*``) |

A call is named by the ``id`` its answer carries; its status is ``queued``, ``running``,
``succeeded`` (with ``data`` as the call answered it), ``failed`` or ``cancelled`` (with ``error``)
(``Call.status``). Only the tenant that made the call may read it; for anyone else it does not
exist (404, never 403).

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
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from services.gateway.auth import TENANT
from services.gateway.calls import REQUEST_ID_HEADER, Call
from services.gateway.context import BRIDGE, PRINCIPAL, RECORDS
from services.gateway.errors import ApiError
from services.gateway.routes import disconnected

log = logging.getLogger(__name__)

GENERATION_ID = re.compile(r"^[0-9a-f]{20}$")
CURSOR = re.compile(r"^[0-9]{1,2}:[0-9]{1,20}-[0-9]{1,20}$")
EVENT_BLOCK_MS = 1000  # one XREAD; between reads the stream checks whether the call ended
EVENTS_PER_READ = 256
HEARTBEAT_S = 15.0
MAX_RECENT = 100


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/requests", list_requests)
    router.add_get("/v1/requests/{id}", get_request)
    router.add_get("/v1/requests/{id}/events", events)
    router.add_post("/v1/requests/{id}/cancel", cancel_call)


async def own_call(request: web.Request, admin_reads: bool = False) -> Call:
    """The call ``{id}`` names, if the caller's tenant made it (or, with ``admin_reads``, the caller
    is an admin: the operator view reads any tenant's calls); else 404 (as if it did not exist)."""
    gen_id = request.match_info["id"]
    call = await Call.load(request.app, gen_id) if GENERATION_ID.match(gen_id) else None
    who = request[PRINCIPAL]
    if call is None or (call.rec.tenant != who.tenant and not (admin_reads and who.admin)):
        raise ApiError(404, f"no request {gen_id[:64]!r}", param="id", code="not_found")
    return call


async def get_request(request: web.Request) -> web.Response:
    call = await own_call(request, admin_reads=True)
    return web.json_response(await call.status(request))


async def cancel_call(request: web.Request) -> web.Response:
    """``POST /v1/requests/{id}/cancel``: cancels what has not ended, waits a little for it to end
    (a running image ends once its executors stopped), and answers the status object."""
    call = await own_call(request)
    await call.cancel("cancelled by the tenant")
    return web.json_response(await call.status(request))


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


async def read_events(call: Call, cursor: list[str], block_ms: int) -> list[tuple[int, str, dict[str, Any]]]:
    """The next entries of the call's streams after ``cursor``: (image index, entry id, event)."""
    index = {rid: i for i, rid in enumerate(call.rec.request_ids)}
    after = {rid: cursor[i] for rid, i in index.items()}
    return [
        # A malformed entry still moves the cursor, so it is not read again.
        (index[rid], entry, event if event is not None else {"type": "invalid"})
        for rid, entry, event in await call.app[BRIDGE].read_events(after, block_ms, EVENTS_PER_READ)
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
    call = await own_call(request, admin_reads=True)
    rec = call.rec
    cursor = parse_cursor(request.headers.get("Last-Event-ID"), rec.n)
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies: do not buffer the stream
            REQUEST_ID_HEADER: rec.id,
        }
    )
    await resp.prepare(request)
    ended = [False] * rec.n
    give_up = rec.created + rec.timeout_s + 60  # the call answered 504 by then
    last_write = time.monotonic()
    try:
        async for batch in _batches(call, cursor):
            for i, entry, event in batch:
                cursor[i] = entry
                if event.get("type") == "end":
                    ended[i] = True
                elif event.get("type") == "node":
                    await resp.write(sse("node", {**event, "image": i}, format_cursor(cursor)))
                    last_write = time.monotonic()
            # Done once every image has ended: its ``end`` entry read, or (a stream trimmed, or a
            # result the scheduler gave without one) nothing more to read and its result stored.
            if (all(ended) or not batch) and (await _all_ended(call) or time.time() > give_up):
                done = await call.status(request)
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


async def _batches(call: Call, cursor: list[str]) -> AsyncIterator[list[tuple[int, str, dict[str, Any]]]]:
    while True:
        yield await read_events(call, cursor, EVENT_BLOCK_MS)


async def _all_ended(call: Call) -> bool:
    return all(s.result is not None for s in await call.app[BRIDGE].states(call.rec.request_ids))


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
    data = await asyncio.gather(*(Call(request.app, r).status(request, with_data=False) for r in recs))
    for rec, item in zip(recs, data, strict=True):
        if tenant is None or tenant != who.tenant:
            item["tenant"] = rec.tenant
    return web.json_response({"object": "list", "data": list(data)})
