"""Reading a request body as JSON, strictly and within limits.

Parsing is msgspec's strict JSON: ``NaN``/``Infinity`` literals, numbers beyond 64-bit integers or
doubles (a 5,000-digit integer, ``1e999``), invalid UTF-8, lone surrogates and a byte-order mark
are all refused with 400, as is nesting deeper than :data:`MAX_DEPTH` (checked without recursion,
so no depth reaches a recursive encoder later). Large bodies are parsed in a worker thread so a
megabyte of JSON never stalls the event loop.

Limits:

* :data:`BUS_PAYLOAD_LIMIT` (512 KiB): anything the gateway forwards over NATS (a workflow spec, a
  LoRA registration, an ``ImageRequest`` with its prompt and parameters) must fit in it. NATS
  refuses payloads over 1 MiB; half of that leaves room for the envelope and for the scheduler's
  dispatches, which repeat the prompt. Bodies of routes that forward them are capped at it.
* ``T2I_GATEWAY_MAX_BODY_MB`` (8 MiB): a generation body, which may carry base64 control images
  (they travel through the object store, not the bus).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from services.gateway.errors import ApiError

BUS_PAYLOAD_LIMIT = 512 << 10
MAX_DEPTH = 32
THREAD_ABOVE = 64 << 10  # bodies larger than this are parsed off the event loop

_decoder = msgspec.json.Decoder()


def too_large(what: str, limit: int, param: str | None = None) -> ApiError:
    return ApiError(413, f"{what} is too large (limit {_human(limit)})", param=param, code="too_large")


def _human(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


async def read_body(request: web.Request, limit: int) -> bytes:
    """The raw body, or 413 when it exceeds ``limit`` bytes (at most the app's ``client_max_size``)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large("the request body", limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large("the request body", limit) from None
    if len(raw) > limit:
        raise too_large("the request body", limit)
    return raw


async def read_json(request: web.Request, limit: int) -> Any:
    raw = await read_body(request, limit)
    if len(raw) > THREAD_ABOVE:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    """Strict JSON -> Python values, or a 400 saying what is wrong."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        value = _decoder.decode(raw)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.ValidationError as e:  # a number beyond 64 bits
        raise ApiError(400, f"the request body is not usable JSON: {e}", code="invalid_json") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    check_depth(value)
    return value


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """400 when containers nest deeper than ``limit`` (an explicit stack: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise _too_deep(limit)
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def _too_deep(limit: int = MAX_DEPTH) -> ApiError:
    return ApiError(400, f"the request body nests deeper than {limit} levels", code="invalid_json")


def json_object(body: Any, what: str = "a JSON object") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be {what}", code="invalid_json")
    return body
