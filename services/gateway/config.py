"""Gateway settings (``T2I_GATEWAY_*``)."""

from __future__ import annotations

import msgspec


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True):
    # Where the OpenAI-compatible HTTP API listens (and its /metrics).
    host: str = "127.0.0.1"
    port: int = 8000
    # API keys: "key=tenant" pairs separated by commas; ":admin" after the tenant grants the
    # admin routes (workflow registration), e.g. "sk-alice=alice,sk-ops=ops:admin".
    api_keys: str = ""
    # Or a JSON file {"<key>": {"tenant": "alice", "admin": false}, ...}; both may be given.
    api_keys_file: str = ""
    request_timeout_s: float = 300.0  # an image that takes longer answers 504
    max_n: int = 8  # images per call
    max_inflight: int = 256  # images in progress (all tenants) before answering 429
    tenant_inflight: int = 32  # images in progress for one tenant before answering it 429
    # Requests one tenant may have queued (taken in, not started) across the platform, as the
    # scheduler reports them; beyond it 429 (limits.py). 0: unlimited (the default: the in-flight
    # limit bounds each gateway, and the scheduler's max_tenant_backlog the whole platform).
    tenant_queued: int = 0
    # Measured GPU-seconds one tenant may use per quota window; beyond it 429 until the window
    # ends. 0: no quota (the default). Admins may override both per tenant (limits.py).
    tenant_gpu_s: float = 0.0
    quota_window_s: int = 3600  # the quota window (aligned to the unix epoch)
    max_body_mb: float = 8.0  # a generation body (control images); other bodies: 512 KiB (body.py)
    public_url: str = ""  # base of image URLs for response_format "url" (default: from the request)
    # Webhooks (webhooks.py): the HMAC-SHA256 key that signs them (random at each start when
    # unset: receivers cannot verify those), attempts per delivery, and the first back-off
    # (doubling, capped at 60 s).
    webhook_secret: str = ""
    webhook_attempts: int = 5
    webhook_backoff_s: float = 1.0
