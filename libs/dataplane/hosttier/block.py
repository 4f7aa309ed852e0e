"""Blocks of the host tier: :class:`HostBlock` and the page-aligned mappings behind them."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libs.dataplane.hosttier.tier import HostTier

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class HostBlock:
    """``nbytes`` bytes of one key, in host memory: ``buf`` starts page-aligned and is exactly ``nbytes`` long.

    ``hit``: the bytes were already there (no fill ran in this call). ``cached``: False for an
    uncached private block (the entry did not fit the tier). ``close()`` ends this process's use of
    the bytes (its lease); idempotent. Tensors still viewing ``buf`` after ``close()`` keep the
    mapping alive until they go, but the entry may be evicted meanwhile.
    """

    def __init__(
        self,
        key: str,
        nbytes: int,
        mm: mmap.mmap,
        *,
        hit: bool,
        cached: bool,
        release: Callable[[], None] | None = None,
        tier: HostTier | None = None,
    ) -> None:
        self.key = key
        self.nbytes = nbytes
        self.hit = hit
        self.cached = cached
        self._mm: mmap.mmap | None = mm
        self.buf: memoryview = memoryview(mm)[:nbytes]
        self._tier = tier
        # Tied to the mapping, not to this object: a lease lasts while anything still views the bytes.
        self._finalizer = weakref.finalize(mm, release) if release is not None else None

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is None:
            return
        if self._finalizer is not None:
            self._finalizer()  # queues the lease release (at most once)
        try:
            self.buf.release()
        except BufferError:
            pass
        try:
            mm.close()
        except BufferError:
            # Tensors still view the bytes: the mapping goes when they do (or at HostTier.close()).
            if self._tier is not None:
                self._tier._unmap_later.append(mm)  # noqa: SLF001 - a collaborator in the same package, written together with it
        if self._tier is not None:
            self._tier._drain_soon()  # noqa: SLF001 - a collaborator in the same package, written together with it

    def __enter__(self) -> HostBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else ("hit" if self.hit else "filled")
        return f"<HostBlock {self.key!r} {self.nbytes} bytes {state}{'' if self.cached else ' uncached'}>"


def _reserve(fd: int, size: int) -> None:
    """Allocate the pages now, so a full ``/dev/shm`` fails here rather than with SIGBUS mid-fill."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise


def _fill_mapping(fd: int, size: int, nbytes: int, fill: Callable[[memoryview], None]) -> None:
    mm = mmap.mmap(fd, size)  # shared and writable: only the filler ever maps an entry so
    view = memoryview(mm)[:nbytes]
    try:
        fill(view)
    finally:
        try:
            view.release()
        except BufferError:
            log.warning("a host-tier fill kept a reference to its buffer; it must not write to it again")
        _close_quietly(mm)


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # still exported; unmapped by the GC when the last view goes
