"""One logging set-up for every service: one JSON object per line, carrying the request id.

Every module keeps logging through the standard library (``logging.getLogger(__name__)``); the
root handler renders each record with structlog, so a line is machine-readable without touching the
call sites::

    {"event": "request 0123...-0 succeeded ...", "level": "info", "service": "scheduler",
     "logger": "services.scheduler.shell.service", "request_id": "0123...-0", "call_id": "0123...",
     "timestamp": "2026-11-30T18:00:00.000000Z"}

The request id travels in a context variable (``structlog.contextvars``): a handler binds it once
with :func:`bind_request` and every line logged by that task, by the tasks it starts and by the
threads it hands work to (``asyncio.to_thread`` copies the context) carries it. Asyncio tasks copy
the context when they are created, so binding inside a task never leaks into its siblings.

``T2I_LOG_FORMAT``: ``json`` (the default when stderr is not a terminal: containers, the launcher's
log files) or ``console`` (aligned, human text: the default on a terminal).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from libs.protocol.ids import generation_of

__all__ = [
    "REQUEST_ID_HEADER",
    "bind_request",
    "bind_from_headers",
    "current_request_id",
    "log_format",
    "request_context",
    "setup_logging",
]

FORMATS = ("json", "console")
REQUEST_ID = "request_id"
#: The NATS header a request id travels in between services (the registry's lookups).
REQUEST_ID_HEADER = "T2I-Request-Id"

# Chatty libraries stay at WARNING unless asked.
QUIET = ("nats", "aiohttp.access", "httpx", "diffusers", "transformers")


def log_format(env: dict[str, str] | None = None, tty: bool | None = None) -> str:
    """The format ``T2I_LOG_FORMAT`` asks for (validated), else json unless stderr is a terminal."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    raw = env.get("T2I_LOG_FORMAT", "").strip().lower()
    if raw and raw not in FORMATS:
        raise ValueError(f"T2I_LOG_FORMAT must be one of {', '.join(FORMATS)}, not {raw!r}")
    if raw:
        return raw
    tty = sys.stderr.isatty() if tty is None else tty
    return "console" if tty else "json"


def setup_logging(service: str, level: str = "INFO") -> logging.Logger:
    """Route every record (stdlib and structlog) through one stderr handler in the chosen format.

    Returns the stdlib logger named ``service`` (as before this module rendered JSON)."""
    fmt = log_format()

    def add_service(_logger: object, _name: str, event: dict) -> dict:
        event.setdefault("service", service)
        return event

    shared: list = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        add_service,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.processors.JSONRenderer(sort_keys=False)
        if fmt == "json"
        # Plain tracebacks: rich's would print every frame's locals (secrets among them).
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    )
    last: list = [structlog.processors.format_exc_info] if fmt == "json" else []
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *last, renderer],
    )
    if fmt == "json":  # progress bars (model loading) are not log lines: off, unless asked for
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # a Python warning is a log line too (one JSON object)
    for name in QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    return logging.getLogger(service)


def _ids(request_id: str) -> dict[str, str]:
    # An image request id is ``{call}-{i}``; a call id (the gateway's) has no dash: it is its own call.
    call = generation_of(request_id)
    return {REQUEST_ID: request_id, "call_id": call}


def bind_request(request_id: str, **more: str) -> None:
    """Tag every line the current task (and what it starts) logs from now on with ``request_id``
    and ``call_id`` (the id the gateway answered with, the image request ids' prefix), so one grep
    finds a call's lines in every service."""
    structlog.contextvars.bind_contextvars(**_ids(request_id), **more)


def bind_from_headers(headers: dict[str, str] | None) -> str:
    """For a callback that handles one message after another in one task (a NATS subscription):
    forget the previous message's request id, and bind this one's (from its headers), if any."""
    structlog.contextvars.clear_contextvars()
    rid = headers.get(REQUEST_ID_HEADER, "") if headers else ""
    if rid:
        bind_request(rid[:128])
    return rid


def current_request_id() -> str:
    """The request id bound in this context ("" when none): passed on in NATS headers."""
    return structlog.contextvars.get_contextvars().get(REQUEST_ID, "")


@contextmanager
def request_context(request_id: str, **more: str) -> Iterator[None]:
    """:func:`bind_request` for a block only (for a loop that handles many requests in turn)."""
    tokens = structlog.contextvars.bind_contextvars(**_ids(request_id), **more)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)
