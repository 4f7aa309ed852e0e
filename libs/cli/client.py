"""The gateway's HTTP API as the CLI uses it: JSON calls, the event stream, image downloads.

Every failure becomes one of two exceptions carrying a sentence a person can act on —
``Unreachable`` (nothing answered at the URL) or ``ApiFailure`` (the gateway answered with an
error, in OpenAI's shape) — so the commands never show a traceback for an outside problem. A 404
from a route the gateway does not have (an older gateway; the gateway answers ``no route …``) is
told apart from a 404 for an id, because the remedy differs: upgrade the gateway, not fix the id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from libs.cli import sse

DEFAULT_URL = "http://127.0.0.1:8000"  # the gateway's default port (services/gateway/config.py)
# Beyond the gateway's 15 s heartbeat on event streams: silence this long means the stream is dead.
STREAM_READ_TIMEOUT_S = 60.0
API_KEY = re.compile(r"^[\x21-\x7e]{1,512}$")  # printable ASCII: it travels in a header


class CliError(Exception):
    """A problem to report in one line (no traceback) and exit non-zero."""


class Unreachable(CliError):
    pass


class BadInput(CliError):
    """An argument refused before anything was sent (exit status 2, as for usage errors)."""


@dataclass
class ApiFailure(CliError):
    status: int
    message: str
    code: str | None = None
    param: str | None = None
    method: str = ""
    path: str = ""
    problems: list[str] = field(default_factory=list)  # a refused spec: every problem, with its path

    @property
    def route_missing(self) -> bool:
        """The gateway has no such route at all (it predates the feature), not: no such object."""
        return self.status in (404, 405) and self.message.startswith(("no route", "method "))

    def __str__(self) -> str:
        if self.route_missing:
            return (
                f"this gateway does not offer {self.method} {self.path} (HTTP {self.status}: "
                f"{self.message}); it is older than this CLI — upgrade the gateway"
            )
        where = f" [{self.param}]" if self.param else ""
        code = f", {self.code}" if self.code else ""
        hint = ""
        if self.status == 401:
            hint = " — set T2I_API_KEY or pass --api-key"
        elif self.status == 403:
            hint = " — this needs an admin API key"
        lines = "".join(f"\n  - {p}" for p in self.problems[:50])
        return f"{self.message}{where} (HTTP {self.status}{code}){hint}{lines}"


def check_url(url: str) -> str:
    """The gateway's base URL, without a trailing slash; a clear error for anything else."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or len(url) > 2048:
        raise BadInput(f"--url / T2I_URL must be an http(s) URL such as {DEFAULT_URL}, got {url[:200]!r}")
    return url.rstrip("/")


def check_key(key: str | None) -> str | None:
    if key is None or key == "":
        return None
    if not API_KEY.match(key):
        raise BadInput(
            "--api-key / T2I_API_KEY must be printable ASCII without spaces (at most 512 characters)"
        )
    return key


def _failure(resp: httpx.Response, method: str, path: str) -> ApiFailure:
    try:
        body = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        problems = err.get("problems") if isinstance(err.get("problems"), list) else []
        return ApiFailure(
            resp.status_code,
            str(err.get("message") or resp.reason_phrase),
            err.get("code"),
            err.get("param"),
            method,
            path,
            [f"{p.get('path')}: {p.get('message')}" for p in problems if isinstance(p, dict)],
        )
    text = resp.text.strip()[:300] or resp.reason_phrase
    return ApiFailure(resp.status_code, text, None, None, method, path)


class Gateway:
    """A synchronous client of one gateway (the CLI does one thing at a time)."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float = 30.0) -> None:
        self.url = check_url(url)
        headers = {"User-Agent": "t2i-cli"}
        key = check_key(api_key)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self.http.request(method, path, **kw)
        except httpx.TimeoutException as e:
            raise Unreachable(
                f"the gateway at {self.url} did not answer {method} {path} in time ({e})"
            ) from None
        except httpx.HTTPError as e:
            raise Unreachable(
                f"cannot reach the gateway at {self.url} ({e}); is it running? (set T2I_URL or --url)"
            ) from None

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        files: list[tuple[str, tuple[str, bytes, str]]] | None = None,
    ) -> tuple[int, httpx.Headers, dict[str, Any]]:
        """One call with a JSON answer: (status, headers, body). The request is ``body`` as JSON, or
        with ``files`` a multipart form of ``body``'s fields (text) and the files (field name,
        (file name, bytes, content type)). Any status >= 400 raises ``ApiFailure``."""
        if files is not None:
            form = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (body or {}).items()}
            resp = self._send(method, path, data=form, files=files, params=params, headers=headers)
        else:
            resp = self._send(method, path, json=body, params=params, headers=headers)
        if resp.status_code >= 400:
            raise _failure(resp, method, path)
        try:
            data = resp.json() if resp.content else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiFailure(resp.status_code, "the gateway answered something that is not JSON") from None
        if not isinstance(data, dict):
            raise ApiFailure(resp.status_code, "the gateway answered JSON that is not an object")
        return resp.status_code, resp.headers, data

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        return self.call("GET", path, params={k: v for k, v in params.items() if v is not None})[2]

    def events(self, call_id: str, last_id: str | None = None) -> Iterator[sse.Event]:
        """The events of a call from ``last_id`` on (all of them when None), until the stream ends.

        Raises ``ApiFailure`` when the gateway refuses the stream, ``Unreachable`` when the connection
        cannot be made or drops; the caller resumes with the last id it saw.
        """
        path = f"/v1/requests/{call_id}/events"
        headers = {"Accept": "text/event-stream"}
        if last_id:
            headers["Last-Event-ID"] = last_id
        timeout = httpx.Timeout(self.http.timeout.connect, read=STREAM_READ_TIMEOUT_S)
        try:
            with self.http.stream("GET", path, headers=headers, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _failure(resp, "GET", path)
                ctype = resp.headers.get("content-type", "")
                if not ctype.startswith("text/event-stream"):
                    raise ApiFailure(
                        resp.status_code, f"expected an event stream, got {ctype or 'no type'!r}"
                    )
                yield from sse.parse(resp.iter_lines())
        except httpx.HTTPError as e:
            raise Unreachable(f"the event stream from {self.url}{path} broke off ({e})") from None

    def download(self, url: str) -> bytes:
        """An image named by a ``url`` item: the gateway's own file route, with the API key."""
        target = urljoin(self.url + "/", url)
        if urlsplit(target).netloc != urlsplit(self.url).netloc:
            # Never send the API key to another host; fetch such a URL without it.
            try:
                resp = httpx.get(target, timeout=self.http.timeout)
            except httpx.HTTPError as e:
                raise Unreachable(f"cannot download {target} ({e})") from None
        else:
            resp = self._send("GET", target)
        if resp.status_code >= 400:
            raise _failure(resp, "GET", urlsplit(target).path)
        return resp.content
