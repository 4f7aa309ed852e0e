"""Connecting to NATS the way every service needs it.

nats-py does not retry a *first* connect (``nats.connect`` raises at once; see docs/substrate.md), so :func:`connect` loops until the
server answers or ``timeout`` passes; once connected the client reconnects forever.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)


async def connect(url: str, name: str, wait_s: float = 30.0) -> Client:
    deadline = time.monotonic() + wait_s
    last: Exception | None = None

    async def error_cb(e: Exception) -> None:
        log.warning("nats error: %s", e)

    async def disconnected_cb() -> None:
        log.warning("disconnected from nats")

    async def reconnected_cb() -> None:
        log.info("reconnected to nats")

    while time.monotonic() < deadline:
        try:
            return await nats.connect(
                url,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                allow_reconnect=True,
                error_cb=error_cb,
                disconnected_cb=disconnected_cb,
                reconnected_cb=reconnected_cb,
            )
        except Exception as e:  # noqa: BLE001 - any failure to reach the server means "try again"
            last = e
            await asyncio.sleep(0.2)
    raise ConnectionError(f"could not connect to NATS at {url} within {wait_s:.0f}s: {last}")
