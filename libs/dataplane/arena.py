"""Arenas: one fixed-size region of memory per executor, sub-allocated with a buddy allocator.

Paper §5.2: "each executor reserves a fixed-size arena ... and manages [it] with a buddy
allocator". An :class:`Arena` is the thread-safe owner of that region: it hands out blocks
(waiting, up to a timeout, for a consumer to release one when the arena is full), maps offsets to
bytes, and frees the memory on close. Host arenas expose their bytes as a ``memoryview``; the GPU
arena (``transport/nvshmem.py``) keeps the same allocation interface over device memory.

Torch-free: the transports and the scheduler-side code import this module.

Device memory (a CUDA allocation, NVSHMEM's symmetric heap) is :class:`~libs.dataplane.device_arena.TensorArena`'s.

Lifetimes. ``close()`` never waits for readers. A memoryview or tensor still referring to the
arena after ``close()`` keeps the *mapping* alive (so it never points at freed memory) but the
segment name is gone and nothing can be allocated. Drop tensors before closing to actually
return the memory.
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shm binding (what SharedMemory uses); present on Linux/macOS
import logging
import mmap
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory
from types import TracebackType

from libs.dataplane.buddy import BuddyAllocator
from libs.dataplane.errors import ArenaClosedError, ArenaFullError, DataPlaneError
from libs.errors import is_retryable

log = logging.getLogger(__name__)

_SEGMENT_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Linux NAME_MAX is 255; macOS allows only 31 characters for POSIX shm names.
_MAX_SEGMENT_NAME = 255


def segment_name(namespace: str, executor_id: str) -> str:
    """The shared-memory segment name of an executor's arena: ``t2i-<namespace>-<executor_id>``.

    ``namespace`` isolates deployments (and test runs) on one host; both parts may contain only
    letters, digits, ``_``, ``.`` and ``-`` (a ``/`` would make the name invalid for shm_open).
    """
    for what, part in (("namespace", namespace), ("executor_id", executor_id)):
        if not _SEGMENT_NAME.fullmatch(part):
            raise ValueError(f"{what} {part!r} may contain only letters, digits, '_', '.', '-'")
    name = f"t2i-{namespace}-{executor_id}"
    if len(name) > _MAX_SEGMENT_NAME:
        raise ValueError(f"segment name {name!r} is longer than {_MAX_SEGMENT_NAME} characters")
    return name


def unlink_segment(name: str) -> bool:
    """Remove the segment ``name`` if it exists (a stale arena of a crashed executor); True if it did."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def segment_exists(name: str) -> bool:
    """Whether a shared-memory segment called ``name`` exists on this host."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0)
    except FileNotFoundError:
        return False
    os.close(fd)
    return True


class Segment:
    """A mapping of an existing segment that this process does not own (a peer's arena).

    Deliberately *not* a ``SharedMemory``: on Python 3.11 every ``SharedMemory`` — attached or
    created — registers with ``multiprocessing.resource_tracker``, which unlinks the segment when
    the attaching process exits. Unregistering right after attaching is not enough either: spawn
    children share their parent's tracker, so the unregister also erases the *owner's*
    registration (and the owner's later unlink makes the tracker print a KeyError). Mapping the
    segment ourselves never involves the tracker, so a consumer exiting cannot destroy a
    producer's arena.
    """

    def __init__(self, name: str, *, writable: bool = False, keep_fd: bool = False) -> None:
        flags = os.O_RDWR if writable else os.O_RDONLY
        fd = _posixshmem.shm_open("/" + name, flags, mode=0)
        try:
            st = os.fstat(fd)
            self.name = name
            self.size = st.st_size
            self.ident = (st.st_dev, st.st_ino, st.st_size)
            if self.size == 0:
                # mmap refuses empty files; an empty segment is a producer mid-creation.
                raise DataPlaneError(f"shared-memory segment {name!r} is empty")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.size, prot=prot)
        except BaseException:
            os.close(fd)
            raise
        # With keep_fd the descriptor stays open for linked(): one fstat per check instead of a
        # shm_open + fstat + close by name. It is closed after the mapping (close()).
        self._fd = fd if keep_fd else -1
        if not keep_fd:
            os.close(fd)
        self.view: memoryview = memoryview(self._mmap)

    @property
    def fd(self) -> int:
        """The descriptor kept open with ``keep_fd`` (-1 without, and once closed)."""
        return self._fd

    @staticmethod
    def current_ident(name: str) -> tuple[int, int, int] | None:
        """(device, inode, size) of the segment now called ``name``, or None if there is none.

        Lets a reader notice that a cached mapping is stale: the producer died (unlinked) or was
        restarted under the same name (new inode).
        """
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return (st.st_dev, st.st_ino, st.st_size)

    def linked(self) -> bool:
        """Whether the segment this maps is still linked (False once anyone unlinked it: its owner
        closing, a successor replacing it, the resource tracker after a crash), by one ``fstat`` of
        the descriptor kept open (``keep_fd``); without one, by comparing the identity of the
        segment now called ``name`` (three syscalls). False after ``close()``.

        Segments are only ever created (``O_EXCL``) and unlinked, never renamed or hard-linked, so
        a linked segment is the one its name refers to.
        """
        fd = self._fd
        if fd < 0:
            return self._mmap is not None and self.current_ident(self.name) == self.ident
        try:
            return os.fstat(fd).st_nlink > 0
        except OSError:  # closed under us by another thread's close()
            return False

    def close(self) -> None:
        """Unmap (never unlinks). If a slice is still in use elsewhere the GC unmaps it later.

        The view goes first and the descriptor last: a thread that checked ``linked()`` through a
        descriptor number that close() had already given back (and the OS reused) then finds the
        view released and cannot read."""
        if self._mmap is None:
            return
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a concurrent reader still holds a slice; the mapping dies with it
        self._mmap = None
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class Arena:
    """Thread-safe block allocation over ``capacity`` bytes of memory (host memory in this class).

    ``allocate`` waits on a condition variable while the arena is full, up to ``timeout``
    seconds; ``free`` wakes the waiters. Offsets are ``min_block``-aligned, so any dtype view of
    a block is aligned (the backing memory is page-aligned).
    """

    kind = "abstract"
    #: Device of the arena's memory, recorded in TensorMeta.device.
    device = "cpu"
    #: Whether blocks are tensor views (``tensor(offset, nbytes)``: :class:`TensorArena`) rather than
    #: memoryviews of host memory (``view``).
    holds_tensors = False

    def __init__(self, name: str, capacity: int, min_block: int = 256) -> None:
        self.name = name
        self._alloc = BuddyAllocator(capacity, min_block)
        # An RLock because it knows its owner exactly (_is_owned), which lets free_soon() tell
        # "a GC finalizer fired inside one of this thread's own arena operations" (defer: the
        # allocator may be mid-update) from "another thread" (just wait for the lock).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._deferred: deque[int] = deque()
        self._waiting = 0
        self._closed = False
        self._buf: memoryview | None = None
        self._reclaimer: Callable[[int], int] | None = None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._cond:
            try:
                yield
            finally:
                if self._deferred:
                    self._drain_deferred()

    def _drain_deferred(self) -> None:
        while self._deferred:
            offset = self._deferred.popleft()
            if not self._closed:
                self._alloc.free(offset)
        self._cond.notify_all()

    # --- allocation ----------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def min_block(self) -> int:
        return self._alloc.min_block

    @property
    def closed(self) -> bool:
        return self._closed

    def set_reclaimer(self, reclaimer: Callable[[int], int] | None) -> None:
        """``reclaimer(nbytes)`` frees blocks held by cached weights (returning the bytes freed) when
        an allocation does not fit: communication takes space from cached weights before it would
        wait (the paper's weight virtualisation, §5.3). Called without the arena's lock held."""
        self._reclaimer = reclaimer

    def allocate(self, nbytes: int, timeout: float | None = None, reclaim: bool = True) -> int:
        """Reserve a block of at least ``nbytes`` and return its offset.

        When nothing fits, cached weights in the arena are reclaimed first (with ``reclaim``, the
        default: what communication does; weights placing themselves pass False). Then
        ``timeout=None`` (or <= 0) fails at once with ArenaFullError; otherwise wait up to
        ``timeout`` seconds for frees. A request larger than the arena fails at once
        (non-retryable). Raises ArenaClosedError if the arena is or becomes closed.
        """
        # The first attempt, inlined (it is on every pull): the lock, the allocator, and the
        # deferred frees drained on the way out, as _locked() does.
        with self._cond:
            try:
                if self._closed:
                    raise ArenaClosedError(self.name)
                try:
                    return self._alloc.alloc(nbytes)
                except ArenaFullError as exc:
                    if not is_retryable(exc):
                        raise
            finally:
                if self._deferred:
                    self._drain_deferred()
        reclaimer = self._reclaimer if reclaim else None
        while reclaimer is not None and reclaimer(nbytes) > 0:  # outside the lock: it frees blocks
            with self._locked():
                self._check_open()
                try:
                    return self._alloc.alloc(nbytes)
                except ArenaFullError:
                    continue  # freed, but not a block that fits yet (buddy fragments): more
        with self._locked():
            self._check_open()
            try:
                return self._alloc.alloc(nbytes)
            except ArenaFullError:
                if timeout is None or timeout <= 0:
                    raise
            # Wait for frees. Any free may merge into a block that fits, so waiters re-try on
            # every notification (a free wakes all of them: their sizes differ). No FIFO order:
            # a small request may overtake a large one that is still waiting.
            deadline = time.monotonic() + timeout
            self._waiting += 1
            self._cond.notify_all()  # for wait_for_waiters()
            try:
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        a = self._alloc
                        raise ArenaFullError(nbytes, a.capacity, a.free_bytes, a.largest_free)
                    self._cond.wait(remaining)
                    self._check_open()
                    try:
                        return self._alloc.alloc(nbytes)
                    except ArenaFullError:
                        continue
            finally:
                self._waiting -= 1

    @property
    def waiting(self) -> int:
        """Allocations currently waiting for space (a back-pressure signal worth exporting)."""
        with self._locked():
            return self._waiting

    def wait_for_waiters(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` allocations are waiting for space (or ``timeout``).

        Lets callers (and tests) sequence "the arena is full and someone is blocked" without
        sleeping. Returns whether the condition was reached.
        """
        deadline = time.monotonic() + timeout
        with self._locked():
            while self._waiting < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(remaining)
            return True

    def free(self, offset: int) -> None:
        """Return a block; wakes allocations waiting for space. A no-op after ``close()``.

        Raises ValueError for an offset that is not allocated (double free).
        """
        with self._cond:
            try:
                if self._closed:
                    return
                self._alloc.free(offset)
                # Only allocations wait on the condition for frees (wait_for_waiters waits for
                # _waiting to grow, which allocate() announces itself).
                if self._waiting:
                    self._cond.notify_all()
            finally:
                if self._deferred:
                    self._drain_deferred()

    def free_soon(self, offset: int) -> None:
        """Free from any context, including a GC finalizer that fires inside one of this arena's
        own locked operations (then the block is freed as that operation ends)."""
        if self._lock._is_owned():  # type: ignore[attr-defined]  # noqa: SLF001 - threading's lock-owner test has no public name
            self._deferred.append(offset)
        else:
            self.free(offset)

    def block_size(self, offset: int) -> int:
        with self._locked():
            return self._alloc.block_size(offset)

    @property
    def used_bytes(self) -> int:
        with self._locked():
            return self._alloc.used_bytes

    @property
    def free_bytes(self) -> int:
        with self._locked():
            return self._alloc.free_bytes

    @property
    def largest_free(self) -> int:
        with self._locked():
            return self._alloc.largest_free

    def stats(self) -> dict[str, int]:
        """One consistent snapshot: capacity, used, free, largest_free, blocks."""
        with self._locked():
            a = self._alloc
            return {
                "capacity": a.capacity,
                "used": a.used_bytes,
                "free": a.free_bytes,
                "largest_free": a.largest_free,
                "blocks": a.allocated_blocks,
            }

    # --- memory --------------------------------------------------------------------------------

    @property
    def buf(self) -> memoryview:
        """The whole arena as a writable byte memoryview (host arenas only)."""
        if self._buf is None:
            raise ArenaClosedError(self.name)
        return self._buf

    def view(self, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` bytes of the arena at ``offset`` (bounds-checked, never out of range)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside arena of {self.capacity} bytes")
        return self.buf[offset : offset + nbytes]

    def fence(self) -> None:
        """Return once every write queued into the arena has landed (device arenas: the writer's
        stream synchronised), so a peer that reads a block after its tag is stamped sees the bytes.
        Host arenas' writes are done when they return: nothing to wait for."""

    # --- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Release the memory; idempotent. Waiting allocations fail with ArenaClosedError."""
        with self._locked():
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        buf, self._buf = self._buf, None
        if buf is not None:
            try:
                buf.release()
            except BufferError:
                pass  # exported directly (not via a slice); the backing mapping outlives it
        self._release_backing()

    def _release_backing(self) -> None:
        """Subclasses free their backing memory here (called once, after ``close``)."""

    def _check_open(self) -> None:
        if self._closed:
            raise ArenaClosedError(self.name)

    def __enter__(self) -> Arena:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._alloc.used_bytes}/{self.capacity} used"
        return f"<{type(self).__name__} {self.name!r} {state}>"


class HeapArena(Arena):
    """An arena in this process's private memory (single-process use, tests, the TCP transport).

    Backed by an anonymous mmap rather than a bytearray: page-aligned (so 256-byte offsets give
    aligned dtype views) and committed lazily by the kernel.
    """

    kind = "heap"

    def __init__(self, capacity: int, min_block: int = 256, name: str = "heap") -> None:
        super().__init__(name, capacity, min_block)
        self._mmap: mmap.mmap | None = mmap.mmap(-1, capacity)
        self._buf = memoryview(self._mmap)

    def _release_backing(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                log.debug("arena %s closed while tensors still view it; unmapped when they go", self.name)
            self._mmap = None


class ShmArena(Arena):
    """An arena in a named POSIX shared-memory segment that peers on this host map and read.

    ``create=True`` (the executor owning the arena): unlink a stale segment of the same name (a
    crashed predecessor's), create it, and reserve its pages up front (``reserve=True``) so a
    too-small ``/dev/shm`` fails here with a clear error instead of SIGBUS on a later write.
    ``close()`` unlinks it. The creator stays registered with the resource tracker, so a crashed
    executor's segment is still cleaned up when its process tree exits.

    ``create=False`` maps an existing segment read-write without owning it (not unlinked on
    close, never registered with the resource tracker). Only one process may allocate in a
    segment: the allocator lives in the process, not in the segment.
    """

    kind = "shm"

    def __init__(
        self, name: str, capacity: int, create: bool = True, *, min_block: int = 256, reserve: bool = True
    ) -> None:
        if not _SEGMENT_NAME.fullmatch(name) or len(name) > _MAX_SEGMENT_NAME:
            raise ValueError(f"invalid shared-memory segment name {name!r}")
        super().__init__(name, capacity, min_block)
        self._owner = create
        self._shm: shared_memory.SharedMemory | None = None
        self._segment: Segment | None = None
        if create:
            if unlink_segment(name):
                log.warning("removed stale shared-memory segment %s", name)
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=capacity)
            if reserve:
                self._reserve(capacity)
            self._buf = self._shm.buf[:capacity]
        else:
            try:
                self._segment = Segment(name, writable=True)
            except FileNotFoundError:
                raise DataPlaneError(f"shared-memory segment {name!r} does not exist") from None
            if self._segment.size < capacity:
                size = self._segment.size
                self._segment.close()
                raise DataPlaneError(f"segment {name!r} has {size} bytes, fewer than capacity {capacity}")
            self._buf = self._segment.view[:capacity]

    def _reserve(self, capacity: int) -> None:
        assert self._shm is not None
        try:
            reserve_segment(self._shm, self.name, capacity)
        except DataPlaneError:
            self._shm.close()
            self._shm.unlink()
            self._shm = None
            self._closed = True
            raise

    @property
    def owner(self) -> bool:
        return self._owner

    def _release_backing(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        shm, self._shm = self._shm, None
        if shm is None:
            return
        try:
            shm.close()
        except BufferError:
            # Tensors still view the arena: keep the mapping for them, but close the descriptor
            # and remove the name now so the segment disappears with its last reader.
            log.debug("arena %s closed while tensors still view it; unmapped when they go", self.name)
            # Drop SharedMemory's references too, or its __del__ retries close() and complains.
            shm._mmap = None  # type: ignore[attr-defined]  # noqa: SLF001 - CPython's SharedMemory keeps its mapping private
            fd = getattr(shm, "_fd", -1)
            if fd >= 0:
                os.close(fd)
                shm._fd = -1  # type: ignore[attr-defined]  # noqa: SLF001 - CPython's SharedMemory keeps its descriptor private
        if self._owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def reserve_segment(shm: shared_memory.SharedMemory, name: str, size: int) -> None:
    """Back ``size`` bytes of a new shared-memory segment now (``posix_fallocate``), so a full
    ``/dev/shm`` fails here with a clear error rather than as a SIGBUS on first touch. A filesystem
    that cannot reserve (macOS) is left as it is."""
    try:
        os.posix_fallocate(shm._fd, 0, size)  # type: ignore[attr-defined]  # noqa: SLF001 - CPython's SharedMemory keeps its descriptor private
    except OSError as exc:
        if exc.errno in (95, 45):  # EOPNOTSUPP / ENOTSUP (macOS): nothing to reserve with
            return
        raise DataPlaneError(
            f"cannot reserve {size} bytes of shared memory for {name!r} ({exc.strerror}); "
            "is /dev/shm large enough?"
        ) from exc
