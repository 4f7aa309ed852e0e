"""The ModelFn catalog: ModelFn classes installed on this machine, found through entry points.

Built-in ModelFns and user packages register classes under the entry-point group
``serverless_t2i.modelfns`` (name -> ``module:Class``); user code reaches executors as installed
Python packages, never as code uploaded over HTTP. The registry reads only the classes'
signatures, which needs no torch (ModelFn modules import torch lazily).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from importlib.metadata import entry_points

from libs.errors import T2IError
from libs.workflow.modelfn import ModelFn, Signature

GROUP = "serverless_t2i.modelfns"
log = logging.getLogger(__name__)


class UnknownModelFn(T2IError, LookupError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown ModelFn {name!r}: no entry point {name!r} in group {GROUP!r}")


@lru_cache(maxsize=1)
def _entry_points() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_class(name: str) -> type[ModelFn]:
    ep = _entry_points().get(name)
    if ep is None:
        raise UnknownModelFn(name)
    cls = ep.load()  # type: ignore[attr-defined]
    if not (isinstance(cls, type) and issubclass(cls, ModelFn)):
        raise TypeError(f"entry point {name!r} is {cls!r}, not a ModelFn subclass")
    if cls.fn_name != name:
        raise TypeError(f"entry point {name!r} points at {cls.__name__} whose fn_name is {cls.fn_name!r}")
    return cls


def names() -> list[str]:
    return sorted(_entry_points())


def signatures() -> dict[str, Signature]:
    """Signatures of every installed ModelFn; a broken plugin is logged and left out."""
    out: dict[str, Signature] = {}
    for name in names():
        try:
            out[name] = load_class(name).signature()
        except Exception as e:  # noqa: BLE001 - one broken plugin must not hide the others
            log.error("ModelFn %s cannot be loaded: %s", name, e)
    return out
