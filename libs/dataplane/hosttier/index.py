"""The host tier's shared state: file names, the on-disk index, critical sections, owner liveness.

Every process of a box reads and rewrites the index file (msgspec JSON) only under ``fcntl.flock``
of the tier's lock file (:meth:`HostTier._locked <libs.dataplane.hosttier.tier.HostTier._locked>`);
an owner is alive while it holds its owner file locked. See :mod:`libs.dataplane.hosttier`.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from libs.dataplane.hosttier.tier import HostTier

_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}")
_FILLING, _READY = "filling", "ready"
#: Counters kept box-wide in the index and per process; ``stats()`` reports both.
COUNTERS = (
    "hits",
    "misses",
    "fills",
    "bytes_filled",
    "bytes_served",
    "evictions",
    "reclaimed",
    "waits",
    "uncached",
)


def _prefix(name: str) -> str:
    # The dot ends the name (names have none), so one tier's files never match another's prefix.
    return f"t2i-hosttier-{name}."


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"tier name {name!r} must be 1-100 letters, digits, '_' or '-'")


# --- the index -----------------------------------------------------------------------------------


class _Entry(msgspec.Struct):
    segment: str  # file name in root, unique for ever (sequence number + random suffix)
    nbytes: int
    size: int  # nbytes rounded up to pages: what the budget counts
    state: str  # _FILLING or _READY
    filler: str = ""  # owner token while filling
    last_use: int = 0  # LRU clock value of the last fill or hit
    tags: list[str] = []
    leases: dict[str, int] = {}  # owner token -> open blocks


class _Index(msgspec.Struct):
    version: int = 1
    seq: int = 0
    clock: int = 0
    entries: dict[str, _Entry] = {}
    counters: dict[str, int] = {}


_decode_index = msgspec.json.Decoder(_Index).decode
_encode_index = msgspec.json.Encoder().encode


@dataclass
class _Txn:
    """One critical section: the index as read, and files to unlink once the lock is released."""

    idx: _Index
    doomed: list[str] = field(default_factory=list)

    def count(self, tier: HostTier, counter: str, n: int = 1) -> None:
        self.idx.counters[counter] = self.idx.counters.get(counter, 0) + n
        tier._local[counter] += n  # noqa: SLF001 - a collaborator in the same package, written together with it


def _owner_alive(path: str) -> bool:
    """An owner is alive while it holds its owner file locked (the kernel drops the lock at exit)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
