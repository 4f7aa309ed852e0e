"""Connecting to NATS the way every service needs it.

nats-py does not retry a *first* connect (``nats.connect`` raises at once; see docs/substrate.md), so :func:`connect` loops until the
server answers or ``timeout`` passes; once connected the client reconnects forever.

Credentials come as userinfo in the URL (``libs.common.settings`` puts ``T2I_NATS_USER`` and
``T2I_NATS_PASSWORD`` there); they are taken out of it, unquoted and passed to nats-py on their own.
A client with a user also gets its own inbox prefix, ``_INBOX.<user>``, so the server can let each
user subscribe to its own replies only (docs/security.md) instead of to everybody's ``_INBOX.>``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
from nats.aio.client import Client

from libs.common.settings import redact

log = logging.getLogger(__name__)


def inbox_prefix(user: str) -> str:
    """The inbox prefix of ``user``'s connections: one subject token per user."""
    return "_INBOX." + re.sub(r"[^A-Za-z0-9_-]", "_", user) if user else "_INBOX"


def split_credentials(url: str) -> tuple[str, str, str]:
    """(url without userinfo, user, password), both unquoted; empty strings without userinfo."""
    parts = urlsplit(url)
    if parts.username is None:
        return url, "", ""
    netloc = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.username), unquote(parts.password or "")


async def connect(url: str, name: str, wait_s: float = 30.0) -> Client:
    deadline = time.monotonic() + wait_s
    last: Exception | None = None
    server, user, password = split_credentials(url)
    auth = {"user": user, "password": password} if user else {}

    async def error_cb(e: Exception) -> None:
        log.warning("nats error: %s", e)

    async def disconnected_cb() -> None:
        log.warning("disconnected from nats")

    async def reconnected_cb() -> None:
        log.info("reconnected to nats")

    while time.monotonic() < deadline:
        try:
            return await nats.connect(
                server,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                allow_reconnect=True,
                error_cb=error_cb,
                disconnected_cb=disconnected_cb,
                reconnected_cb=reconnected_cb,
                inbox_prefix=inbox_prefix(user),
                **auth,
            )
        except Exception as e:  # noqa: BLE001 - any failure to reach the server means "try again"
            last = e
            await asyncio.sleep(0.2)
    raise ConnectionError(f"could not connect to NATS at {redact(url)} within {wait_s:.0f}s: {last}")
