"""API keys -> tenants.

Keys come from ``T2I_GATEWAY_API_KEYS`` and/or a JSON file. Only SHA-256 digests are kept in
memory, so a heap dump does not leak keys, and lookups compare digests.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool = False


class ApiKeys:
    def __init__(self, keys: dict[str, Principal]) -> None:
        self._by_digest = {_digest(k): p for k, p in keys.items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, key: str) -> Principal | None:
        return self._by_digest.get(_digest(key))

    @classmethod
    def load(cls, spec: str = "", file: str = "") -> ApiKeys:
        keys: dict[str, Principal] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, rest = item.partition("=")
            tenant, _, role = rest.partition(":")
            if not sep or not key or role not in ("", "admin"):
                raise ValueError(f"bad API key entry {item[:4]}...: expected key=tenant or key=tenant:admin")
            keys[key] = Principal(_tenant(tenant), role == "admin")
        if file:
            data = json.loads(Path(file).read_text())
            if not isinstance(data, dict):
                raise ValueError(f"{file}: expected an object of key -> {{tenant, admin}}")
            for key, entry in data.items():
                if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str):
                    raise ValueError(f"{file}: entry for {key[:4]}... needs a string 'tenant'")
                keys[key] = Principal(_tenant(entry["tenant"]), bool(entry.get("admin", False)))
        return cls(keys)


def _tenant(name: str) -> str:
    if not TENANT.match(name):
        raise ValueError(f"tenant name {name!r} must match {TENANT.pattern}")
    return name


def _digest(key: str) -> bytes:
    # Header values may carry surrogates (bytes that are not UTF-8): they must still hash.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
