"""Callback inputs inside a model's forward: fetch on first use (paper §5.2, Fig. 8-right).

A base model receives its ControlNet's outputs as a :class:`~libs.workflow.modelfn.Deferred`.
Handing the model a lazy stand-in instead of the fetched tensors lets its forward start at once;
the fetch happens when a block first touches the control outputs, so the ControlNet (running in
parallel on another executor) has until then to produce them.

* :class:`LazyList` stands in for a list of block samples: ``len``, indexing or iterating fetches.
* :class:`LazyAddend` stands in for one tensor that the model only *adds* (``x + residual``), as a
  UNet does with its mid-block residual: the reflected ``__radd__`` fetches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any


class LazyList(Sequence):
    def __init__(self, fetch: Callable[[], Any], pick: Callable[[Any], Sequence] = lambda v: v) -> None:
        self._fetch = fetch
        self._pick = pick
        self._items: Sequence | None = None

    def _get(self) -> Sequence:
        if self._items is None:
            self._items = list(self._pick(self._fetch()))
        return self._items

    @property
    def fetched(self) -> bool:
        return self._items is not None

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, i):  # type: ignore[override]
        return self._get()[i]

    def __iter__(self) -> Iterator:
        return iter(self._get())


class LazyAddend:
    """``x + LazyAddend(fetch)`` fetches and adds (torch returns NotImplemented to unknown types)."""

    def __init__(self, fetch: Callable[[], Any]) -> None:
        self._fetch = fetch
        self._value: Any = None

    def value(self) -> Any:
        if self._value is None:
            self._value = self._fetch()
        return self._value

    @property
    def fetched(self) -> bool:
        return self._value is not None

    def __radd__(self, other: Any) -> Any:
        return other + self.value()

    def __add__(self, other: Any) -> Any:
        return self.value() + other
