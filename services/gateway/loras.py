"""LoRA adapters over HTTP: registered by admins, listed by name for everyone.

A LoRA's ``path`` says where executors find its weights, relative to their model root
(``T2I_EXECUTOR_MODEL_ROOT``). It is an operator's detail: no response shows it, to admins or
tenants — they see the name and the description. A path that is absolute or climbs out of the
model root (a ``..`` segment) is refused here with 422, before the registration reaches the registry.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from libs.protocol.messages import LoraInfo
from services.gateway.errors import ApiError, invalid

WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:")
FIELDS = ("name", "path", "description")


def public(lora: LoraInfo) -> dict[str, Any]:
    """What a client may see of a LoRA: never its path."""
    return {"object": "lora", "name": lora.name, "description": lora.description}


def check_path(path: str) -> None:
    """422 unless ``path`` is relative and stays inside the model root."""
    if "\x00" in path:
        raise invalid("path", "must not contain NUL characters")
    if path.startswith(("/", "\\", "~")) or WINDOWS_DRIVE.match(path):
        raise invalid("path", "must be relative to the executors' model root, not an absolute path")
    if ".." in re.split(r"[/\\]", path):
        raise invalid("path", "must not contain `..` (it must stay inside the model root)")


def parse_registration(body: dict[str, Any]) -> LoraInfo:
    for key in body:
        if key not in FIELDS:
            raise invalid(key, "unknown field")
    for key in ("name", "path"):
        if not isinstance(body.get(key), str):
            raise invalid(key, "is required (a string)")
    if not isinstance(body.get("description", ""), str):
        raise invalid("description", "must be a string")
    check_path(body["path"])
    return LoraInfo(name=body["name"], path=body["path"], description=body.get("description", ""))


def registry_error(status: int, error: str, param: str | None) -> ApiError:
    """The registry's refusal as an HTTP error; a status the registry should not send becomes 502."""
    if not 400 <= status < 600:
        status = 502
    return ApiError(status, error or "the registry refused the LoRA", param=param, code="invalid_value")


def lora_name(request: web.Request) -> str:
    name = request.match_info["name"]
    if not name or len(name) > 64:
        raise ApiError(404, f"no LoRA {name[:64]!r}", param="name", code="not_found")
    return name
