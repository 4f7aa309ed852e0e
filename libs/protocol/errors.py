"""Errors of the wire formats: a message or identifier off the bus that does not parse."""

from __future__ import annotations

from libs.errors import T2IError


class BadTensorMetaError(T2IError, ValueError):
    """Tensor metadata that arrived off the bus is malformed; ``field`` names the culprit."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"bad tensor metadata: {field}: {reason}")
