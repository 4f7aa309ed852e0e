"""The host tier: one copy of each checkpoint's bytes in host memory, shared by every executor of a box.

Executors load model weights from disk into host memory before using them (on CPU the host bytes
*are* the weights; on GPU they are copied to the device). :class:`HostTier` keeps those bytes in
shared memory under a byte budget, so two executors on one box never read the same checkpoint from
disk twice, and a model an executor evicted comes back from host memory, not disk.

Design: no tier process, just files and a lock. Every process of the box opens the same tier (same
``name``, ``budget_bytes`` and ``root``) and cooperates through

* one file per entry in ``root`` (``/dev/shm``: POSIX shared memory; any directory works), mapped
  with ``mmap`` so every process sees the same pages, zero-copy (``torch.frombuffer`` over a block's
  ``buf`` makes tensors of them);
* an index file (msgspec JSON: entries, their state, leases, LRU clock, box-wide counters),
  replaced atomically and read and written only under ``fcntl.flock`` of the tier's lock file.
  Everything done under the lock is short (parse, decide, create or unlink a file); reading a
  checkpoint into an entry (``fill``) always happens outside it.

A separate process would own the memory more tidily, but it is one more thing to start, supervise
and talk to, and its death would take every entry with it; files and a lock need no supervisor,
survive any one process, and the kernel releases a dead process's locks.

Entries and their states. An entry is ``filling`` (one process is writing it) or ``ready``
(immutable from then on). A key's bytes never change after ready: a block is mapped copy-on-write
(``block_access="copy"``: writes, e.g. to CPU weights, stay private to the process) or read-only
(``"read"``), never writable-shared; a refill only happens after eviction, into a fresh file.

Leases and liveness. Every open :class:`HostBlock` is a lease recorded in the index under its
*owner*, one per :class:`HostTier` object: a token ``{pid}-{random}`` with an owner file
``root/…owner-{token}`` that the owner holds ``flock``-ed for its lifetime. An owner is alive iff
its file is locked. This is used rather than ``os.kill(pid, 0)`` because executors of one box
usually run in separate containers (separate PID namespaces: a pid means nothing to another
container, and pids are reused), while a lock on a shared file is visible across containers and
dies exactly with its holder. A dead owner's leases are void and its half-filled entries are
reclaimed (unlinked, filled again by the next caller), so a crash leaks nothing.

Eviction is LRU by last use (a hit counts), under ``budget_bytes`` counting each entry's size
rounded up to whole pages. Entries that a live owner leases or fills are never evicted. If an entry
cannot fit even after evicting everything evictable, nothing is evicted and the caller gets an
*uncached* private block (``cached=False``) instead of an error.

The budget counts what the tier holds, not what processes map: an evicted entry's file is unlinked
at once, but a process that still maps it keeps valid memory until it unmaps (POSIX semantics), and
the pages return to the system only then. Leases end with ``HostBlock.close()`` (or when the
block's mapping is garbage-collected), so keep a block open as long as tensors view its bytes.

Processes must not use a tier across ``fork`` (the owner lock would be shared with the child);
create one per process. Torch-free.
"""

from __future__ import annotations

from libs.dataplane.errors import HostTierError
from libs.dataplane.hosttier.block import PAGE, HostBlock
from libs.dataplane.hosttier.index import COUNTERS
from libs.dataplane.hosttier.tier import MAX_KEY_LENGTH, MAX_TAG_LENGTH, HostTier

__all__ = ["COUNTERS", "MAX_KEY_LENGTH", "MAX_TAG_LENGTH", "PAGE", "HostBlock", "HostTier", "HostTierError"]
