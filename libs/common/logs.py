"""One logging set-up for every service: ``time level service message``."""

from __future__ import annotations

import logging
import sys


def setup_logging(service: str, level: str = "INFO") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Chatty libraries stay at WARNING unless asked.
    for name in ("nats", "aiohttp.access", "httpx", "diffusers", "transformers"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    return logging.getLogger(service)
