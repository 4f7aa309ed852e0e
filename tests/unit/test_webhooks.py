"""Webhook signing, URL checks and the retry schedule; event-stream cursors (services/gateway)."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from aiohttp import web

from services.gateway import webhooks
from services.gateway.errors import ApiError
from services.gateway.routes.images import wants_async
from services.gateway.routes.requests import format_cursor, parse_cursor
from tests.conftest import free_port


def test_a_signature_is_hmac_sha256_of_the_timestamp_and_body():
    header = webhooks.signature_header("s3cret", b'{"id":"x"}', now=1_700_000_000)
    expected = hmac.new(b"s3cret", b'1700000000.{"id":"x"}', hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"
    assert webhooks.verify("s3cret", header, b'{"id":"x"}', now=1_700_000_100)


@pytest.mark.parametrize(
    ("secret", "body", "now"),
    [
        ("other", b'{"id":"x"}', 1_700_000_000),
        ("s3cret", b'{"id":"y"}', 1_700_000_000),
        ("s3cret", b'{"id":"x"}', 1_700_001_000),
    ],
)
def test_a_wrong_secret_a_changed_body_or_an_old_timestamp_does_not_verify(secret, body, now):
    header = webhooks.signature_header("s3cret", b'{"id":"x"}', now=1_700_000_000)
    assert not webhooks.verify(secret, header, body, now=now)


def test_a_malformed_signature_header_does_not_verify():
    for header in ("", "v1=abc", "t=x,v1=abc", "t=1700000000"):
        assert not webhooks.verify("s", header, b"", now=1_700_000_000)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080/hook", "https://hooks.example.com/t2i?x=1"])
def test_http_and_https_urls_are_accepted(url):
    assert webhooks.check_url(url) == url


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("ftp://example.com/", "http or https"),
        ("/relative", "http or https"),
        ("http:///path", "host"),
        ("http://exa mple.com/", "spaces"),
        ("http://example.com:99999/", "valid URL"),
        ("http://u:p@example.com/", "credentials"),
        ("https://example.com/" + "a" * 2048, "2048"),
        (["http://x"], "string"),
    ],
)
def test_bad_urls_are_refused_naming_the_field(url, fragment):
    with pytest.raises(ApiError) as e:
        webhooks.check_url(url)
    assert e.value.status == 422 and e.value.param == "webhook" and fragment in e.value.message


async def test_deliveries_retry_with_doubling_back_off_capped_and_bounded():
    seen: list[bytes] = []

    async def fail(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.Response(status=500)

    app = web.Application()
    app.router.add_post("/", fail)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    hooks = webhooks.Webhooks("s", attempts=6, backoff_s=10.0)
    await hooks.start()
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def body() -> bytes:
        return b"{}"

    try:
        assert not await hooks.deliver(f"http://127.0.0.1:{port}/", "abc", body, sleep=sleep)
    finally:
        await hooks.stop()
        await runner.cleanup()
    assert len(seen) == 6 and slept == [10.0, 20.0, 40.0, 60.0, 60.0]
    assert hooks.failed == 1 and hooks.delivered == 0


async def test_an_unreachable_receiver_is_a_failed_attempt_not_an_error():
    hooks = webhooks.Webhooks("s", attempts=2, backoff_s=0.0)
    await hooks.start()

    async def body() -> bytes:
        return b"{}"

    try:
        assert not await hooks.deliver(f"http://127.0.0.1:{free_port()}/", "abc", body)
    finally:
        await hooks.stop()


def test_event_cursors_round_trip_and_bad_ones_are_refused():
    assert parse_cursor(None, 2) == ["0-0", "0-0"]
    cursor = parse_cursor("0:1733-0,1:1740-2", 2)
    assert cursor == ["1733-0", "1740-2"] and format_cursor(cursor) == "0:1733-0,1:1740-2"
    assert format_cursor(["0-0", "5-1"]) == "1:5-1"
    for bad in ("2:1-0", "x", "0:1733", "0:1-0;1:2-0", "-1:1-0"):
        with pytest.raises(ApiError):
            parse_cursor(bad, 2)


class _Req:
    def __init__(self, *values: str) -> None:
        self.headers = self
        self._values = list(values)

    def getall(self, name: str, default: list) -> list[str]:
        return self._values or default


@pytest.mark.parametrize(
    ("values", "wanted"),
    [
        (("respond-async",), True),
        (("Respond-Async, wait=10",), True),
        (("wait=10", "respond-async; x=1"), True),
        (("return=minimal",), False),
        (("respond-asyncx",), False),
        ((), False),
    ],
)
def test_prefer_respond_async_is_recognised_among_other_preferences(values, wanted):
    assert wants_async(_Req(*values)) is wanted  # type: ignore[arg-type]
