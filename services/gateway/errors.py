"""HTTP errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from aiohttp import web


class ApiError(Exception):
    """An error answered to the client. ``param`` names the offending field."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        if self.status in (401, 403):
            return "authentication_error"
        if self.status == 429:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return web.json_response(body, status=self.status, headers=headers, dumps=json.dumps)


def invalid(param: str, message: str, status: int = 422) -> ApiError:
    return ApiError(status, f"{param}: {message}", param=param, code="invalid_value")
