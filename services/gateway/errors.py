"""HTTP errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error response also says whether repeating the same call could help, in ``x-should-retry``
(the header OpenAI's and Stripe's clients read): ``false`` for a 4xx a retry would only repeat,
``true`` for 408/409/429 and the transient 5xx (502/503/504). A plain 500 carries no header: the
client's own policy decides.
"""

from __future__ import annotations

import json

from aiohttp import web

SHOULD_RETRY = "x-should-retry"
RETRYABLE_4XX = frozenset({408, 409, 429})
RETRYABLE_5XX = frozenset({502, 503, 504})


def should_retry(status: int) -> str | None:
    """The ``x-should-retry`` value for a response status, or None for no header."""
    if status in RETRYABLE_4XX or status in RETRYABLE_5XX:
        return "true"
    if 400 <= status < 500:
        return "false"
    return None


class ApiError(Exception):
    """An error answered to the client. ``param`` names the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers: dict[str, str] = {}  # more response headers (``x-request-id``)

    @property
    def type(self) -> str:
        if self.status in (401, 403):
            return "authentication_error"
        if self.status == 429:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def body(self) -> dict[str, object]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self, **extra: object) -> web.Response:
        """The error response; ``extra`` adds fields to the error object (a spec's ``problems``)."""
        headers = dict(self.headers)
        if self.retry_after is not None or self.status in (429, 503):
            headers["Retry-After"] = str(self.retry_after if self.retry_after is not None else 1)
        retry = should_retry(self.status)
        if retry is not None:
            headers[SHOULD_RETRY] = retry
        return web.json_response(
            {"error": {**self.body(), **extra}}, status=self.status, headers=headers, dumps=json.dumps
        )


def invalid(param: str, message: str, status: int = 422) -> ApiError:
    return ApiError(status, f"{param}: {message}", param=param, code="invalid_value")


async def add_retry_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every error response the app sends carries ``x-should-retry``."""
    if SHOULD_RETRY not in response.headers:
        retry = should_retry(response.status)
        if retry is not None:
            response.headers[SHOULD_RETRY] = retry
