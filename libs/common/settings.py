"""Settings every service shares: where NATS and Redis are, and the namespace.

The namespace prefixes every NATS subject, stream, bucket and Redis key, so several deployments
(or test runs) share one NATS and one Redis without colliding.
"""

from __future__ import annotations

import re

import msgspec

from libs.common.config import ConfigError, load_config

NAMESPACE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


class CommonSettings(msgspec.Struct, forbid_unknown_fields=True):
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "t2i"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not NAMESPACE.match(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} must match {NAMESPACE.pattern}")


def common_settings(env=None) -> CommonSettings:
    """Read ``T2I_NATS_URL``, ``T2I_REDIS_URL``, ``T2I_NAMESPACE``, ``T2I_LOG_LEVEL``."""
    import os

    env = os.environ if env is None else env
    mine = {
        k: v
        for k, v in env.items()
        if k in {"T2I_NATS_URL", "T2I_REDIS_URL", "T2I_NAMESPACE", "T2I_LOG_LEVEL"}
    }
    try:
        return load_config(CommonSettings, "T2I_", mine)
    except ValueError as e:
        raise ConfigError(str(e)) from None
