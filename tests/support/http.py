"""An image generation call with an ``Idempotency-Key``, for tests that repeat calls across faults."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def generate(url: str, api_key: str, body: dict, idempotency_key: str, timeout: float) -> tuple[int, dict]:
    """POST ``body`` to ``url``/v1/images/generations; (status, JSON body). Never raises: a broken
    connection or a timeout is status 0."""
    req = urllib.request.Request(
        url + "/v1/images/generations", data=json.dumps(body).encode(), method="POST"
    )
    req.add_header("Authorization", f"Bearer {api_key}")
    req.add_header("Content-Type", "application/json")
    req.add_header("Idempotency-Key", idempotency_key)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except json.JSONDecodeError:
            return e.code, {}
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, {}
