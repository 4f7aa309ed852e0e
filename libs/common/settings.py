"""Settings every service shares: where NATS and Redis are, the credentials for them, the namespace.

The namespace prefixes every NATS subject, stream, bucket and Redis key, so several deployments
(or test runs) share one NATS and one Redis without colliding.

Credentials (docs/security.md): each service connects as its role's user. They come either as
userinfo in the URLs (``nats://user:password@host:4222``, ``redis://user:password@host:6379/0``) or
as ``T2I_NATS_USER``/``T2I_NATS_PASSWORD`` and ``T2I_REDIS_USER``/``T2I_REDIS_PASSWORD``; a
``*_PASSWORD_FILE`` variant reads the password from a file (a mounted secret). The separate settings
are folded into the URLs here, so every service keeps connecting with ``nats_url``/``redis_url``;
:func:`redact` hides the password wherever a URL is printed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import quote, urlsplit, urlunsplit

import msgspec

from libs.common.config import ConfigError, load_config

NAMESPACE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


#: Where a machine's brokers answer when nothing says otherwise (written here only).
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class CommonSettings(msgspec.Struct, forbid_unknown_fields=True):
    # The brokers; the namespace that prefixes every subject, stream, bucket and Redis key (test runs
    # and deployments on one pair of brokers each take their own); the log level.
    nats_url: str = DEFAULT_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL
    namespace: str = "t2i"
    log_level: str = "INFO"
    # Logs: "json" (one object per line) or "console"; "" picks json unless stderr is a terminal.
    log_format: Literal["", "json", "console"] = ""
    # Where the scheduler, registry and executors serve ``/metrics`` (docs/observability.md):
    # port 0 picks a free one (logged as ``metrics_url``), -1 serves none. The gateway serves its
    # metrics on its own port.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    # The service's NATS user (its role's: docs/security.md) and its password, or a file holding it;
    # ``user:password@`` in the URL works too.
    nats_user: str = ""
    nats_password: str = ""
    nats_password_file: str = ""
    # The same for Redis (an ACL user); executors need one only for the GPU lease.
    redis_user: str = ""
    redis_password: str = ""
    redis_password_file: str = ""

    def __post_init__(self) -> None:
        if not NAMESPACE.match(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} must match {NAMESPACE.pattern}")
        if self.log_format not in ("", "json", "console"):
            raise ValueError(f"log_format must be json or console, not {self.log_format!r}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must be a port number, 0 (any free port) or -1 (none), not {self.metrics_port}"
            )
        nats_pw = _password(self.nats_password, self.nats_password_file, "T2I_NATS_PASSWORD")
        redis_pw = _password(self.redis_password, self.redis_password_file, "T2I_REDIS_PASSWORD")
        self.nats_url = with_userinfo(self.nats_url, self.nats_user, nats_pw)
        self.redis_url = with_userinfo(self.redis_url, self.redis_user, redis_pw)
        # The passwords now live in the URLs only (and repr() redacts those).
        self.nats_password = self.redis_password = ""

    def __repr__(self) -> str:
        return (
            f"CommonSettings(nats_url={redact(self.nats_url)!r}, redis_url={redact(self.redis_url)!r}, "
            f"namespace={self.namespace!r}, log_level={self.log_level!r})"
        )


def _password(value: str, file: str, name: str) -> str:
    if value and file:
        raise ValueError(f"set {name} or {name}_FILE, not both")
    if file:
        try:
            return Path(file).read_text().strip()
        except OSError as e:
            raise ValueError(f"{name}_FILE: cannot read {file}: {e.strerror}") from None
    return value


def with_userinfo(url: str, user: str, password: str) -> str:
    """``url`` with ``user:password@`` (URL-quoted) in place of any userinfo it had; unchanged when
    neither is given. Redis accepts a password alone (the ``default`` user); NATS needs a user."""
    if not user and not password:
        return url
    parts = urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"cannot add credentials to {redact(url)!r}: no host")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    info = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    return urlunsplit(parts._replace(netloc=f"{info}@{netloc}"))


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{netloc}"))


SETTINGS = {f"T2I_{f.upper()}" for f in CommonSettings.__struct_fields__}


def common_settings(env=None) -> CommonSettings:
    """Read ``T2I_NATS_URL``, ``T2I_REDIS_URL``, ``T2I_NAMESPACE``, ``T2I_LOG_LEVEL`` and the
    credentials (``T2I_{NATS,REDIS}_{USER,PASSWORD,PASSWORD_FILE}``)."""
    import os

    env = os.environ if env is None else env
    mine = {k: v for k, v in env.items() if k in SETTINGS}
    try:
        return load_config(CommonSettings, "T2I_", mine)
    except ValueError as e:
        raise ConfigError(str(e)) from None
