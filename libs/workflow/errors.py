"""Errors of the programming model: composition mistakes and invalid workflow specs."""

from __future__ import annotations

from dataclasses import dataclass

from libs.errors import T2IError


class CompositionError(T2IError, ValueError):
    """A workflow being composed in Python is malformed (raised at composition time)."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: ``path`` names the field (``body[2].inputs.latents``)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(T2IError, ValueError):
    """A workflow spec failed validation. Carries every problem found, each naming its field.

    Never retryable: the same spec fails the same way.
    """

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


class ParamError(T2IError, ValueError):
    """A request's workflow parameters do not match the spec (``field`` names the parameter)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")
