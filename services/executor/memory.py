"""How much of the box an executor's memory tiers take by default."""

from __future__ import annotations

import os

# The host tier's default share: of the box's memory (its cgroup's limit inside a container) or of
# the filesystem holding the tier's segments (/dev/shm, a tmpfs), whichever is smaller. Half leaves
# the other half to the executors' own processes, the page cache the loader reads through, and the
# data-plane arenas (which live in the same /dev/shm).
HOST_TIER_FRACTION = 0.5


def memory_bytes() -> int:
    """The memory this process may use: the cgroup's limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) where one is set, else the machine's physical memory."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))  # v1 writes a huge number when unlimited
    return total


def default_host_tier_mb(root: str) -> int:
    """The host tier's budget in MiB when ``T2I_EXECUTOR_HOST_TIER_MB`` is not set:
    :data:`HOST_TIER_FRACTION` of the smaller of :func:`memory_bytes` and the size of the
    filesystem at ``root`` (0, no tier, where ``root`` cannot be read)."""
    try:
        st = os.statvfs(root)
    except OSError:
        return 0
    return int(HOST_TIER_FRACTION * min(memory_bytes(), st.f_frsize * st.f_blocks)) >> 20
