"""Retrying idempotent bus operations that time out under load.

A JetStream publish carrying a ``Nats-Msg-Id`` is deduplicated by the server, and object-store
reads and writes of one name are idempotent, so a few bounded retries turn a transient timeout into
a slower success instead of a failed request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.errors import ConnectionReconnectingError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

T = TypeVar("T")
log = logging.getLogger(__name__)
TRANSIENT = (NatsTimeoutError, TimeoutError, NoRespondersError, ConnectionReconnectingError)


async def retry(op: Callable[[], Awaitable[T]], what: str, attempts: int = 4, delay_s: float = 0.2) -> T:
    for i in range(attempts):
        try:
            return await op()
        except TRANSIENT as e:
            if i == attempts - 1:
                raise
            log.warning("%s: %s; retrying (%d/%d)", what, type(e).__name__, i + 1, attempts - 1)
            await asyncio.sleep(delay_s * (2**i))
    raise AssertionError("unreachable")
