"""The root of the platform's errors, and the one way to ask whether a retry can help.

Every error a package defines (in its own ``errors.py``) derives from :class:`T2IError`. Those that a
retry may cure (a peer that may come back, an arena that frees up, a registry briefly down) derive
from :class:`RetryableError`; an error whose answer depends on its data (an arena request larger
than the whole arena is never retryable, a smaller one is) sets ``retryable`` on the instance.
Callers ask :func:`is_retryable` rather than probing attributes, so a foreign exception (a bug, a
library error) is never retried by accident.
"""

from __future__ import annotations

__all__ = ["RetryableError", "T2IError", "is_retryable"]


class T2IError(Exception):
    """Base of every error the platform raises on purpose. Not retryable unless it says so."""

    retryable: bool = False


class RetryableError(T2IError):
    """An error that the same call may not hit later (something transient on the way)."""

    retryable = True


def is_retryable(exc: BaseException) -> bool:
    """Whether running the same operation again may succeed."""
    return isinstance(exc, T2IError) and exc.retryable
