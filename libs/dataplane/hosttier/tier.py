"""The host tier itself: :class:`HostTier` (lookup, eviction, filling, leases; see :mod:`libs.dataplane.hosttier`)."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec

from libs.dataplane.errors import HostTierError
from libs.dataplane.hosttier.block import HostBlock, _close_quietly, _fill_mapping, _pages, _reserve
from libs.dataplane.hosttier.index import (
    _FILLING,
    _READY,
    COUNTERS,
    _check_name,
    _decode_index,
    _encode_index,
    _Entry,
    _Index,
    _owner_alive,
    _prefix,
    _Txn,
    _unlink,
)

log = logging.getLogger(__name__)

MAX_KEY_LENGTH = 1024
MAX_TAG_LENGTH = 256
_ACCESS = {"copy": mmap.ACCESS_COPY, "read": mmap.ACCESS_READ}


@dataclass
class _Plan:
    kind: str  # "hit", "fill", "wait", "uncached"
    fd: int = -1
    segment: str = ""
    size: int = 0


class HostTier:
    """A box-wide LRU cache of immutable byte blobs in shared memory (see the package docstring).

    ``name``: a namespace-like token (letters, digits, ``_``, ``-``); every process of the box
    passes the same ``name``, ``budget_bytes`` and ``root``. ``block_access``: how blocks are
    mapped once ready, ``"copy"`` (copy-on-write: writable, writes private; CPU executors) or
    ``"read"`` (read-only shared pages; GPU executors, which pin them with
    ``cudaHostRegisterReadOnly`` — pinning a copy-on-write mapping copies it). ``wait_timeout_s``
    bounds the wait for another process's fill; past it the caller fills an uncached block itself.
    """

    def __init__(
        self,
        name: str,
        budget_bytes: int,
        root: str | Path = "/dev/shm",
        *,
        block_access: str = "copy",
        wait_timeout_s: float = 600.0,
    ) -> None:
        _check_name(name)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, not {budget_bytes!r}")
        if block_access not in _ACCESS:
            raise ValueError(f"block_access must be one of {sorted(_ACCESS)}, not {block_access!r}")
        self.name = name
        self.budget_bytes = budget_bytes
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"host tier root {str(self.root)!r} is not a directory")
        self._access = _ACCESS[block_access]
        self._wait_timeout_s = wait_timeout_s
        self._prefix = _prefix(name)
        self._pid = os.getpid()
        self._token = f"{self._pid}-{secrets.token_hex(6)}"
        self._local = dict.fromkeys(COUNTERS, 0)
        self._thread_lock = threading.Lock()
        self._releases: deque[tuple[str, str]] = deque()  # (key, segment) of ended leases
        self._unmap_later: list[mmap.mmap] = []
        self._open_leases = 0
        self._closed = False
        self._lock_fd = os.open(self._path("lock"), os.O_RDWR | os.O_CREAT, 0o600)
        self._owner_fd = -1
        try:
            with self._locked() as txn:
                # Created and locked under the tier lock: a sweeper never sees it unlocked.
                self._owner_fd = os.open(self._owner_path(self._token), os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(self._owner_fd, fcntl.LOCK_EX)
                self._sweep_files(txn)
        except BaseException:
            self._release_fds()
            raise

    # --- public API ------------------------------------------------------------------------------

    def get_or_fill(
        self, key: str, nbytes: int, fill: Callable[[memoryview], None], tags: Iterable[str] = ()
    ) -> HostBlock:
        """The bytes of ``key``: mapped from the tier on a hit, else filled by ``fill(buf)`` here.

        ``fill`` runs at most once box-wide per entry: a caller that finds the key being filled by
        another live process waits for it. A failing ``fill`` removes the entry and its error
        propagates. If the entry cannot fit the budget, ``fill`` runs into an uncached private block.
        ``tags`` (model keys, say) are attached to the entry and reported by :meth:`tags`.
        """
        self._check_usable()
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
            raise ValueError(f"key must be a non-empty str of at most {MAX_KEY_LENGTH} characters")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, not {nbytes!r}")
        tag_list = sorted(set(tags))
        for tag in tag_list:
            if not isinstance(tag, str) or not tag or len(tag) > MAX_TAG_LENGTH:
                raise ValueError(f"tags must be non-empty str of at most {MAX_TAG_LENGTH} characters")
        deadline = time.monotonic() + self._wait_timeout_s
        delay = 0.002
        waited = False
        while True:
            with self._locked() as txn:
                plan = self._plan(txn, key, nbytes, tag_list, waited)
            if plan.kind == "hit":
                return self._block(key, nbytes, plan, hit=True, cached=True)
            if plan.kind == "fill":
                return self._fill_entry(key, nbytes, fill, plan)
            if plan.kind == "uncached":
                return self._fill_private(key, nbytes, fill)
            waited = True
            if time.monotonic() >= deadline:
                log.warning(
                    "host tier %s: %r still being filled by another process after %.0f s; reading it privately",
                    self.name,
                    key,
                    self._wait_timeout_s,
                )
                with self._locked() as txn:
                    txn.count(self, "misses")
                    txn.count(self, "uncached")
                return self._fill_private(key, nbytes, fill)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is ready in the tier (an entry still being filled is not)."""
        self._check_usable()
        with self._locked() as txn:
            entry = txn.idx.entries.get(key)
            return entry is not None and entry.state == _READY

    def tags(self) -> set[str]:
        """The union of the tags of ready entries (what an executor reports as in host memory)."""
        return self.report()[0]

    def stats(self) -> dict[str, int]:
        """Box-wide counters (``hits``, ``misses``, …), the same per process (``process_hits``, …),
        and the tier's state: ``used_bytes``, ``budget_bytes``, ``entries`` (ready or filling),
        ``ready_entries``, ``leased_entries``."""
        return self.report()[1]

    def report(self) -> tuple[set[str], dict[str, int]]:
        """:meth:`tags` and :meth:`stats` from one read of the index (an executor's heartbeat)."""
        self._check_usable()
        with self._locked() as txn:
            idx = txn.idx
            tags = {t for e in idx.entries.values() if e.state == _READY for t in e.tags}
            out = {c: idx.counters.get(c, 0) for c in COUNTERS}
            out.update({f"process_{c}": n for c, n in self._local.items()})
            out["used_bytes"] = sum(e.size for e in idx.entries.values())
            out["budget_bytes"] = self.budget_bytes
            out["entries"] = len(idx.entries)
            out["ready_entries"] = sum(e.state == _READY for e in idx.entries.values())
            out["leased_entries"] = sum(bool(e.leases) for e in idx.entries.values())
            return tags, out

    def close(self) -> None:
        """Stop using the tier: ended leases are recorded, closed blocks still mapped (tensors were
        viewing them) are unmapped if they can be now. Blocks still open stay valid and keep their
        leases until they close; the owner lock goes with the last one. Idempotent."""
        if self._closed:
            return
        self._closed = True
        still = []
        for mm in self._unmap_later:
            try:
                mm.close()
            except BufferError:
                still.append(mm)  # the GC unmaps it when its last view goes
        self._unmap_later = still
        if os.getpid() == self._pid and self._lock_fd >= 0:
            with self._locked():
                pass  # drains ended leases
        self._maybe_release_fds()

    @staticmethod
    def destroy(name: str, root: str | Path = "/dev/shm") -> None:
        """Remove every file of tier ``name`` in ``root``: entries, index, owner files, lock (tests, operators).

        Meant for when no process uses the tier any more; processes still mapping an entry keep
        valid memory until they unmap it.
        """
        _check_name(name)
        root = Path(root)
        prefix = _prefix(name)
        lock_path = root / (prefix + "lock")
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            fd = -1
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX)
            with os.scandir(root) as it:
                names = [e.name for e in it if e.name.startswith(prefix) and e.name != lock_path.name]
            for file in names:
                _unlink(root / file)
            _unlink(lock_path)
        finally:
            if fd >= 0:
                os.close(fd)

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<HostTier {self.name!r} budget {self.budget_bytes} in {str(self.root)!r}>"

    # --- deciding, under the lock -----------------------------------------------------------------

    def _plan(self, txn: _Txn, key: str, nbytes: int, tags: list[str], waited: bool) -> _Plan:
        idx = txn.idx
        entry = idx.entries.get(key)
        if entry is not None and entry.nbytes != nbytes:
            raise HostTierError(self.name, key, f"holds {entry.nbytes} bytes, asked for {nbytes}")
        if entry is not None and entry.state == _READY:
            try:
                fd = os.open(self._path_of(entry.segment), os.O_RDONLY)
            except FileNotFoundError:
                log.warning("host tier %s: file of %r vanished; dropping the entry", self.name, key)
                del idx.entries[key]
                entry = None
            else:
                idx.clock += 1
                entry.last_use = idx.clock
                entry.leases[self._token] = entry.leases.get(self._token, 0) + 1
                if not set(tags) <= set(entry.tags):
                    entry.tags = sorted(set(entry.tags) | set(tags))
                txn.count(self, "hits")
                txn.count(self, "bytes_served", nbytes)
                self._open_leases += 1
                return _Plan("hit", fd, entry.segment, entry.size)
        if entry is not None:  # filling, by a live owner (the sweep reclaimed dead ones)
            if not waited:
                txn.count(self, "waits")
            return _Plan("wait")
        txn.count(self, "misses")
        size = _pages(nbytes)
        victims = self._victims(idx, size)
        if victims is None:
            txn.count(self, "uncached")
            return _Plan("uncached")
        for victim in victims:
            txn.doomed.append(idx.entries.pop(victim).segment)
            txn.count(self, "evictions")
        idx.seq += 1
        segment = f"{self._prefix}seg-{idx.seq}-{secrets.token_hex(4)}"
        fd = os.open(self._path_of(segment), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            _unlink(self._path_of(segment))
            raise
        idx.clock += 1
        idx.entries[key] = _Entry(
            segment, nbytes, size, _FILLING, filler=self._token, last_use=idx.clock, tags=tags
        )
        return _Plan("fill", fd, segment, size)

    def _victims(self, idx: _Index, size: int) -> list[str] | None:
        """Keys to evict, least recently used first, so that ``size`` more bytes fit; None if they cannot."""
        if size > self.budget_bytes:
            return None
        used = sum(e.size for e in idx.entries.values())
        victims: list[str] = []
        evictable = sorted(
            (e.last_use, k) for k, e in idx.entries.items() if e.state == _READY and not e.leases
        )
        for _, key in evictable:
            if used + size <= self.budget_bytes:
                break
            victims.append(key)
            used -= idx.entries[key].size
        return victims if used + size <= self.budget_bytes else None

    # --- filling, outside the lock ---------------------------------------------------------------

    def _fill_entry(
        self, key: str, nbytes: int, fill: Callable[[memoryview], None], plan: _Plan
    ) -> HostBlock:
        fd = plan.fd
        try:
            try:
                _reserve(fd, plan.size)
            except OSError as exc:
                log.warning(
                    "host tier %s: cannot reserve %d bytes in %s (%s); %r stays uncached",
                    self.name,
                    plan.size,
                    self.root,
                    exc.strerror,
                    key,
                )
                self._abandon(key, plan.segment, count_uncached=True)
                return self._fill_private(key, nbytes, fill)
            try:
                _fill_mapping(fd, plan.size, nbytes, fill)
            except BaseException:
                self._abandon(key, plan.segment)
                raise
            with self._locked() as txn:
                entry = txn.idx.entries.get(key)
                cached = entry is not None and entry.segment == plan.segment
                if cached:
                    assert entry is not None
                    txn.idx.clock += 1
                    entry.state, entry.filler, entry.last_use = _READY, "", txn.idx.clock
                    entry.leases[self._token] = entry.leases.get(self._token, 0) + 1
                    txn.count(self, "fills")
                    txn.count(self, "bytes_filled", nbytes)
                    self._open_leases += 1
                else:  # the tier was destroyed meanwhile; the bytes are still ours
                    txn.doomed.append(plan.segment)
            return self._block(key, nbytes, plan, hit=False, cached=cached)
        finally:
            if plan.fd >= 0:
                os.close(plan.fd)
                plan.fd = -1

    def _abandon(self, key: str, segment: str, *, count_uncached: bool = False) -> None:
        """Remove the entry this process was filling (if it is still there) and its file."""
        with self._locked() as txn:
            entry = txn.idx.entries.get(key)
            if entry is not None and entry.segment == segment:
                del txn.idx.entries[key]
            txn.doomed.append(segment)  # a fresh name: nobody else can be using it
            if count_uncached:
                txn.count(self, "uncached")

    def _fill_private(self, key: str, nbytes: int, fill: Callable[[memoryview], None]) -> HostBlock:
        mm = mmap.mmap(-1, _pages(nbytes))  # anonymous: page-aligned, private to this process
        view = memoryview(mm)[:nbytes]
        try:
            fill(view)
        except BaseException:
            view.release()
            _close_quietly(mm)
            raise
        view.release()
        return HostBlock(key, nbytes, mm, hit=False, cached=False)

    def _block(self, key: str, nbytes: int, plan: _Plan, *, hit: bool, cached: bool) -> HostBlock:
        try:
            mm = mmap.mmap(plan.fd, plan.size, access=self._access)
        except BaseException:
            if cached:
                self._release_soon(key, plan.segment)
                self._drain_soon()
            raise
        finally:
            os.close(plan.fd)
            plan.fd = -1
        if not cached:
            return HostBlock(key, nbytes, mm, hit=hit, cached=False)
        release = _LeaseRelease(weakref.ref(self), key, plan.segment)
        return HostBlock(key, nbytes, mm, hit=hit, cached=True, release=release, tier=self)

    # --- leases ----------------------------------------------------------------------------------

    def _release_soon(self, key: str, segment: str) -> None:
        """Record that a lease ended; safe from a GC finalizer (no locks: applied at the next call)."""
        self._releases.append((key, segment))

    def _drain_soon(self) -> None:
        """Apply ended leases now (after an explicit close), so other processes may evict at once."""
        if os.getpid() != self._pid or self._lock_fd < 0:
            return
        with self._locked():
            pass
        self._maybe_release_fds()

    def _apply_releases(self, idx: _Index) -> None:
        while self._releases:
            key, segment = self._releases.popleft()
            self._open_leases -= 1
            entry = idx.entries.get(key)
            if entry is None or entry.segment != segment:
                continue
            left = entry.leases.get(self._token, 0) - 1
            if left > 0:
                entry.leases[self._token] = left
            else:
                entry.leases.pop(self._token, None)

    # --- the lock, the index and the files -------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[_Txn]:
        if self._lock_fd < 0:
            raise HostTierError(self.name, "", "the tier is closed")
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                raw, idx = self._read_index()
                txn = _Txn(idx)
                self._apply_releases(idx)
                self._sweep_owners(txn)
                yield txn
                data = _encode_index(idx)
                if data != raw:
                    self._write_index(data)
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        for segment in txn.doomed:  # only once the index no longer names them
            _unlink(self._path_of(segment))

    def _read_index(self) -> tuple[bytes, _Index]:
        try:
            raw = Path(self._path("index")).read_bytes()
        except FileNotFoundError:
            return b"", _Index()
        try:
            idx = _decode_index(raw)
            for entry in idx.entries.values():
                if not entry.segment.startswith(self._prefix + "seg-") or "/" in entry.segment:
                    raise ValueError(f"bad segment name {entry.segment!r}")
            return raw, idx
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            # Entries whose files the sweep below removes; mappings of them stay valid.
            log.error("host tier %s: unreadable index (%s); starting empty", self.name, exc)
            idx = _Index()
            self._sweep_segments(idx)
            return b"", idx

    def _write_index(self, data: bytes) -> None:
        tmp = self._path("index.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, self._path("index"))  # atomic: a crash mid-write leaves the old index

    def _sweep_owners(self, txn: _Txn) -> None:
        """Void the leases of dead owners and reclaim the entries they were filling."""
        alive: dict[str, bool] = {}
        for key, entry in list(txn.idx.entries.items()):
            for token in list(entry.leases):
                if not self._alive(token, alive):
                    del entry.leases[token]
            if entry.state == _FILLING and not self._alive(entry.filler, alive):
                log.warning("host tier %s: reclaiming %r, whose filler %s died", self.name, key, entry.filler)
                del txn.idx.entries[key]
                txn.doomed.append(entry.segment)
                txn.count(self, "reclaimed")
        for token, is_alive in alive.items():
            if not is_alive:
                _unlink(self._owner_path(token))

    def _alive(self, token: str, cache: dict[str, bool]) -> bool:
        if token == self._token:
            return True
        if token not in cache:
            cache[token] = _owner_alive(self._owner_path(token))
        return cache[token]

    def _sweep_files(self, txn: _Txn) -> None:
        """At start-up: remove owner files of dead owners and segments the index does not name."""
        with os.scandir(self.root) as it:
            names = [e.name for e in it if e.name.startswith(self._prefix + "owner-")]
        for name in names:
            token = name.removeprefix(self._prefix + "owner-")
            if token != self._token and not _owner_alive(self._owner_path(token)):
                _unlink(self._owner_path(token))
        self._sweep_segments(txn.idx)

    def _sweep_segments(self, idx: _Index) -> None:
        """Unlink segments no entry names (left by a crash between creating and recording one)."""
        named = {e.segment for e in idx.entries.values()}
        with os.scandir(self.root) as it:
            orphans = [e.name for e in it if e.name.startswith(self._prefix + "seg-") and e.name not in named]
        for name in orphans:
            log.info("host tier %s: removing orphaned segment %s", self.name, name)
            _unlink(self._path_of(name))

    def _check_usable(self) -> None:
        if self._closed:
            raise HostTierError(self.name, "", "the tier is closed")
        if os.getpid() != self._pid:
            raise HostTierError(self.name, "", "used across fork; create a HostTier in each process")

    def _maybe_release_fds(self) -> None:
        if self._closed and self._open_leases <= 0 and not self._releases:
            self._release_fds()

    def _release_fds(self) -> None:
        if self._owner_fd >= 0 and os.getpid() == self._pid:
            _unlink(self._owner_path(self._token))
        for attr in ("_owner_fd", "_lock_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)

    def _path(self, suffix: str) -> str:
        return str(self.root / (self._prefix + suffix))

    def _path_of(self, file: str) -> str:
        return str(self.root / file)

    def _owner_path(self, token: str) -> str:
        return self._path("owner-" + token)


class _LeaseRelease:
    """The finalizer of a cached block's mapping: records the end of its lease (no strong tier ref)."""

    def __init__(self, tier: weakref.ref[HostTier], key: str, segment: str) -> None:
        self._tier, self._key, self._segment = tier, key, segment

    def __call__(self) -> None:
        tier = self._tier()
        if tier is not None:
            tier._release_soon(self._key, self._segment)  # noqa: SLF001 - a collaborator in the same package, written together with it
