"""``Idempotency-Key``: within 24 h, one tenant's key names one generation call.

A repeat with the same key and the same body submits nothing: it waits for and returns that call's
answer (``Call.replay``). A repeat with a different body is refused (422, ``param:
Idempotency-Key``). The key is claimed in Redis with ``SET NX`` (``records.py``), so concurrent
gateways agree; within one process, calls with one key also take turns (:func:`key_turn`) until the
first has claimed it, so a repeat waits for that call instead of taking admission slots of its own
(and a 429 at the limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator

from aiohttp import web

from services.gateway.context import KEY_TURNS
from services.gateway.errors import ApiError
from services.gateway.records import IdempotencyRecord

IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII, no spaces


def idempotency_key(request: web.Request) -> str | None:
    """The request's ``Idempotency-Key``, checked; None without one."""
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


def check_repeat(held: IdempotencyRecord, fp: str) -> None:
    """422 unless a repeat's body (``fp``: its fingerprint) is the body the key was first used with."""
    if held.fingerprint != fp:
        raise ApiError(
            422,
            f"{IDEMPOTENCY_HEADER}: this key was used with a different request body in the last 24 h",
            param=IDEMPOTENCY_HEADER,
            code="idempotency_mismatch",
        )


def being_set_up() -> ApiError:
    """A repeat whose key is claimed by a call not recorded yet (or no longer)."""
    return ApiError(
        409, f"the call of this {IDEMPOTENCY_HEADER} is being set up; retry", code="idempotency_conflict"
    )
