"""Webhooks: a call's final status POSTed to a URL the tenant gave, signed, retried, bounded.

A tenant that does not want to hold a connection open or poll gives ``webhook`` in the body of
``POST /v1/images/generations``; when the call ends the gateway POSTs the call's final status
object (as ``GET /v1/requests/{id}`` answers it) there, as JSON, with

- ``X-T2I-Webhook-Id: <call id>`` — the same on every attempt, so a receiver can drop duplicates
  (delivery is at least once: an attempt that timed out may have arrived);
- ``X-T2I-Signature: t=<unix seconds>,v1=<hex>`` with ``v1 = HMAC-SHA256(secret, f"{t}." + body)``
  — the scheme Stripe uses: the timestamp is signed with the body, so a receiver that refuses old
  timestamps cannot be replayed an old delivery. :func:`verify` is the receiver's side.

An attempt fails on a connection error, a timeout or any answer but 2xx (redirects are not
followed: a receiver that moved should be re-registered, not chased). Failed attempts are retried
up to ``webhook_attempts`` in all, waiting ``webhook_backoff_s`` and doubling, capped at
:data:`MAX_BACKOFF_S`; after the last the delivery is given up and logged. Deliveries run in tasks
of their own, at most :data:`MAX_CONCURRENT` at once per gateway, so a slow receiver cannot hold
up answers or pile up without bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp

from services.gateway.errors import ApiError

log = logging.getLogger(__name__)

ID_HEADER = "X-T2I-Webhook-Id"
SIGNATURE_HEADER = "X-T2I-Signature"
MAX_URL_LEN = 2048
MAX_BACKOFF_S = 60.0
ATTEMPT_TIMEOUT_S = 10.0  # one attempt, connecting and answering
MAX_CONCURRENT = 64  # deliveries in flight per gateway process
VERIFY_TOLERANCE_S = 300


def check_url(value: object) -> str:
    """The ``webhook`` field: an absolute http(s) URL with a host, at most 2048 characters."""
    if not isinstance(value, str):
        raise _invalid(f"must be a string (an http or https URL), got {type(value).__name__}")
    if not value or len(value) > MAX_URL_LEN:
        raise _invalid(f"must be an http or https URL of 1 to {MAX_URL_LEN} characters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in value):
        raise _invalid("must not contain spaces or control characters")
    try:
        parts = urlsplit(value)
        port = parts.port  # raises on a malformed port
    except ValueError as e:
        raise _invalid(f"is not a valid URL: {e}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise _invalid(f"must be an http or https URL, not {parts.scheme or 'a relative one'!r}")
    if not parts.hostname:
        raise _invalid("must name a host")
    if port == 0:
        raise _invalid("must not name port 0")
    if parts.username is not None or parts.password is not None:
        raise _invalid("must not carry credentials (they would show in logs); put a token in the path")
    return value


def _invalid(why: str) -> ApiError:
    return ApiError(422, f"webhook: {why}", param="webhook", code="invalid_value")


def signature(secret: str, t: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()


def signature_header(secret: str, body: bytes, now: float | None = None) -> str:
    t = int(time.time() if now is None else now)
    return f"t={t},v1={signature(secret, t, body)}"


def verify(
    secret: str, header: str, body: bytes, tolerance_s: float = VERIFY_TOLERANCE_S, now: float | None = None
) -> bool:
    """A receiver's check of :data:`SIGNATURE_HEADER`: signed with ``secret``, and recent."""
    fields: dict[str, str] = {}
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        fields.setdefault(name, value)
    try:
        t = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    return hmac.compare_digest(signature(secret, t, body), fields.get("v1", ""))


class Webhooks:
    """Delivers signed webhooks over one shared client session."""

    def __init__(self, secret: str, attempts: int, backoff_s: float) -> None:
        self.secret = secret
        self.attempts = max(1, attempts)
        self.backoff_s = max(0.0, backoff_s)
        self._session: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self.delivered = 0
        self.failed = 0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT_S),
            headers={"User-Agent": "t2i-gateway-webhook/1"},
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def deliver(
        self,
        url: str,
        call_id: str,
        body: Callable[[], Awaitable[bytes]],
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> bool:
        """POST ``await body()`` to ``url`` until an attempt answers 2xx; False when all failed.

        ``body`` is built once, inside the concurrency bound (a status object with its images can
        be large), and each attempt is signed anew (its timestamp is the attempt's).
        """
        async with self._slots:
            payload = await body()
            delay = self.backoff_s
            for attempt in range(1, self.attempts + 1):
                why = await self._attempt(url, call_id, payload)
                if why is None:
                    self.delivered += 1
                    log.info("webhook of %s delivered (attempt %d)", call_id, attempt)
                    return True
                if attempt == self.attempts:
                    break
                log.warning(
                    "webhook of %s: attempt %d of %d failed (%s); retrying in %.1fs",
                    call_id,
                    attempt,
                    self.attempts,
                    why,
                    delay,
                )
                await sleep(delay)
                delay = min(MAX_BACKOFF_S, delay * 2)
            self.failed += 1
            log.warning("webhook of %s given up after %d attempt(s): %s", call_id, self.attempts, why)
            return False

    async def _attempt(self, url: str, call_id: str, payload: bytes) -> str | None:
        """None when delivered, else why not."""
        assert self._session is not None, "Webhooks.start() was not called"
        headers = {
            "Content-Type": "application/json",
            ID_HEADER: call_id,
            SIGNATURE_HEADER: signature_header(self.secret, payload),
        }
        try:
            async with self._session.post(url, data=payload, headers=headers, allow_redirects=False) as r:
                await r.read()
                return None if 200 <= r.status < 300 else f"HTTP {r.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return f"{type(e).__name__}: {e}"[:300]
