"""Typed configuration from environment variables.

Every service reads a ``msgspec.Struct`` from variables named ``<PREFIX><FIELD>`` (upper case), e.g.
``T2I_GATEWAY_PORT``. Fields keep their defaults when unset. A variable that carries the prefix but
names no field is an error, so a typo fails loudly at start-up instead of being ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


class ConfigError(ValueError):
    """A setting is unknown or has the wrong type; the message names the variable."""


def load_config(cls: type[T], prefix: str, env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    env = os.environ if env is None else env
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    raw: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :].lower()
        if name not in fields:
            known = ", ".join(prefix + f.upper() for f in fields)
            raise ConfigError(f"unknown setting {key}; known settings: {known}")
        raw[name] = value
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        # strict=False lets "8000" become 8000 and "true" become True, as env vars are text.
        return msgspec.convert(raw, cls, strict=False)
    except msgspec.DecodeError as e:
        raise ConfigError(f"bad setting under {prefix}*: {e}") from None
