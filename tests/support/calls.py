"""Calls to the gateway by a well-behaved client, recorded attempt by attempt (tests of outages).

A :class:`Call` is one image generation with its own ``Idempotency-Key``. :func:`run_call` sends it
and, like a client that follows the gateway's advice, repeats it with the same key while the
answer says a retry could help (``x-should-retry: true``, after ``Retry-After``) or no answer came
at all (a broken connection or a timeout), until it succeeds, fails for good or a deadline passes.
``retry_5xx``: a cautious client also repeats a plain 500, which carries no advice (safe with the
key: a repeat submits nothing new). Every attempt is kept, so a test can report what a client saw
first and how the call ended.

An answer is *clear* when it is a 200 with images, or an error status with an OpenAI-shaped body
naming ``error.code`` and ``error.message``. No answer (status 0: the connection broke or nothing
came within the timeout) or an error without such a body is not clear: the call, seen from the
client, vanished.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

from tests.support.waiting import elapse_sync

RETRYABLE_WITHOUT_HEADER = (0,)  # no answer at all: the key makes repeating it safe


@dataclass(frozen=True)
class Attempt:
    at: float  # seconds since the call's clock (see run_call's t0)
    status: int  # 0: no answer (broken connection or timeout)
    code: str  # error.code, or "" (200, or no error body)
    message: str
    should_retry: str | None  # the x-should-retry header
    retry_after: float
    images: int  # len(data) of a 200

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.images > 0

    @property
    def clear(self) -> bool:
        return self.ok or (self.status >= 400 and bool(self.code) and bool(self.message))

    @property
    def label(self) -> str:
        return "200" if self.ok else f"{self.status} {self.code or '(no error body)'}"


@dataclass
class Call:
    api_key: str
    body: dict
    idempotency_key: str
    phase: str = ""  # e.g. "before" / "during" / "after" the fault
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def first(self) -> Attempt | None:
        return self.attempts[0] if self.attempts else None

    @property
    def final(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def succeeded(self) -> bool:
        return self.final is not None and self.final.ok

    @property
    def unclear(self) -> list[Attempt]:
        return [a for a in self.attempts if not a.clear]


def attempt(url: str, call: Call, timeout: float, t0: float) -> Attempt:
    """One POST of the call; never raises."""
    req = urllib.request.Request(
        url + "/v1/images/generations", data=json.dumps(call.body).encode(), method="POST"
    )
    req.add_header("Authorization", f"Bearer {call.api_key}")
    req.add_header("Content-Type", "application/json")
    req.add_header("Idempotency-Key", call.idempotency_key)
    start = time.monotonic() - t0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, headers, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, e.headers, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return Attempt(start, 0, "", "", None, 0.0, 0)
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError:
        body = {}
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    data = body.get("data") if isinstance(body, dict) else None
    try:
        retry_after = float(headers.get("Retry-After") or 0)
    except ValueError:
        retry_after = 0.0
    return Attempt(
        start,
        status,
        str(err.get("code") or ""),
        str(err.get("message") or ""),
        headers.get("x-should-retry"),
        retry_after,
        len(data) if isinstance(data, list) and status == 200 else 0,
    )


def run_call(
    url: str, call: Call, deadline: float, t0: float, timeout: float = 60.0, retry_5xx: bool = False
) -> None:
    """Send ``call`` and repeat it (same key) while that could help, until ``deadline`` (monotonic)."""
    while True:
        a = attempt(url, call, min(timeout, max(1.0, deadline - time.monotonic())), t0)
        call.attempts.append(a)
        if a.ok:
            return
        retry = a.should_retry == "true" or a.status in RETRYABLE_WITHOUT_HEADER
        retry = retry or (retry_5xx and a.status >= 500)
        if not retry or time.monotonic() + max(a.retry_after, 0.5) >= deadline:
            return
        elapse_sync(
            max(a.retry_after, 0.5),
            # the advice is a length of time: the client waits it out (a half-second back-off
            # when none came, e.g. no answer at all)
            because="a well-behaved client repeats a call only after the Retry-After it was given",
        )


def start_call(
    url: str, call: Call, deadline: float, t0: float, timeout: float = 60.0, retry_5xx: bool = False
) -> threading.Thread:
    t = threading.Thread(target=run_call, args=(url, call, deadline, t0, timeout, retry_5xx), daemon=True)
    t.start()
    return t


def figures(calls: list[Call]) -> dict[str, object]:
    """The record of a run: calls, attempts, first answers and final outcomes by label, and losses."""
    return {
        "calls": len(calls),
        "attempts": sum(len(c.attempts) for c in calls),
        "first": dict(Counter(c.first.label for c in calls if c.first)),
        "final": dict(Counter(c.final.label for c in calls if c.final)),
        "succeeded": sum(c.succeeded for c in calls),
        "failed_for_good": sum(1 for c in calls if c.final and not c.final.ok and c.final.clear),
        "unclear_answers": sum(len(c.unclear) for c in calls),
        "lost": sum(1 for c in calls if not c.succeeded and (c.final is None or not c.final.clear)),
    }
