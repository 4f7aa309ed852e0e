"""The box's NVSHMEM world over its lifetime (``T2I_EXECUTOR_TRANSPORT=nvshmem``): which generation to
join, what to do when it cannot form, and what happens when one of its PEs dies.

NVSHMEM fixes a world's membership at ``init``: a PE that dies cannot be replaced in it, and a process
cannot reliably leave and re-initialise. So the world has *generations*. The box's current one is the
integer under :func:`generation_key` in Redis (at least ``T2I_EXECUTOR_NVSHMEM_GENERATION``); every
executor starting on the box joins it (rank = the index of the GPU it leased; rank 0's unique id under
that generation's key, libs/dataplane/transport/bootstrap.py).

* **It cannot form** (NVSHMEM missing, no CUDA, rank 0's id not there within
  ``T2I_EXECUTOR_NVSHMEM_JOIN_S``, ``init`` failing): the executor falls back to the CUDA IPC transport
  for its lifetime and says so in its log and heartbeat (``transport``: ``cuda_ipc``). Pulls between it
  and its peers are then device-to-device copies (one per pull, like NVSHMEM's get).
* **A PE dies**: each PE's GPU lease (``libs/common/gpu_lease.py``) is its liveness. :class:`WorldWatch`
  runs in every PE; once a rank's lease is no longer held by the token that held it when the world
  formed (released, lapsed after its TTL, or claimed by a replacement executor), the world is broken:
  the watcher moves the box to the next generation (one compare-and-set, whoever sees it first) and
  the executor falls back to CUDA IPC at once (its transport is a
  :class:`~libs.dataplane.transport.fallback.FallbackTransport`: every executor of a world also holds a
  CUDA IPC arena), so it goes on serving: new tensors go to the CUDA IPC arena, those already in the
  world's arena stay readable until released. Once none is left (or ``T2I_EXECUTOR_NVSHMEM_DRAIN_S``
  passed) the executor ends; its supervisor starts it again and it joins the next generation, which
  forms when every PE of the box has joined (or, after ``_JOIN_S``, does not: CUDA IPC for that
  process's life). What the dead PE held is lost as a dead executor's always is: the scheduler reruns
  what needs it from its lineage. Between an executor's exit and the next world forming, that
  executor serves nothing.

Plain Redis: tested on the CPU with GPU leases of CPU stand-ins (tests/integration/test_nvshmem_world.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from libs.common.gpu_lease import lease_key
from libs.errors import T2IError
from libs.protocol.keys import Keys

log = logging.getLogger(__name__)

#: Moves the generation from ARGV[1] to ARGV[1] + 1 only if it still is ARGV[1] (or unset, or lower):
#: two watchers seeing the same death bump it once.
_BUMP = """
local now = tonumber(redis.call('GET', KEYS[1]) or '-1')
local seen = tonumber(ARGV[1])
if now <= seen then
  redis.call('SET', KEYS[1], seen + 1)
  return seen + 1
end
return now
"""


class WorldBrokenError(T2IError):
    """A PE of this executor's NVSHMEM world died: the executor ends so that the box forms the next
    generation."""


def generation_key(namespace: str, scope: str) -> str:
    """The box's current NVSHMEM world generation (under ``{ns}:gpu:``, the executors' Redis prefix)."""
    return Keys(namespace).nvshmem_generation(scope)


async def current_generation(redis: Any, namespace: str, scope: str, floor: int = 0) -> int:
    """The generation a starting executor joins: the box's current one, at least ``floor``."""
    raw = await redis.get(generation_key(namespace, scope))
    return max(floor, int(raw) if raw is not None else 0)


async def next_generation(redis: Any, namespace: str, scope: str, seen: int) -> int:
    """Mark generation ``seen`` broken: the box's generation becomes ``seen + 1`` unless someone moved
    it on already. Returns the box's generation afterwards."""
    return int(await redis.eval(_BUMP, 1, generation_key(namespace, scope), seen))


def open_world(factory: Callable[[], Any], fallback: Callable[[], Any], what: str) -> tuple[Any, bool]:
    """``factory()`` (the NVSHMEM transport); if it fails with a DataPlaneError (cannot form),
    ``fallback()`` (CUDA IPC). Returns the transport and whether it is the world's."""
    from libs.dataplane.errors import DataPlaneError

    try:
        return factory(), True
    except DataPlaneError as e:
        log.warning("%s cannot form (%s): falling back to the CUDA IPC transport", what, e)
        return fallback(), False


class WorldWatch:
    """Watches the GPU leases of world generation ``generation``'s ranks (``gpus[r]`` is rank r's GPU
    id). Once one is no longer held by the token that held it when :meth:`start` looked, :meth:`run`
    moves the box to the next generation, calls ``fall_back()`` (the executor's transport switches to
    CUDA IPC: it goes on serving), waits until ``drained()`` (no tensor of ours left in the world's
    arena) or ``drain_s`` passed, and raises WorldBrokenError: the executor ends, its supervisor
    starts it again, and it joins the next generation."""

    def __init__(
        self,
        redis: Any,
        namespace: str,
        scope: str,
        gpus: Sequence[str],
        generation: int,
        *,
        period_s: float = 2.0,
        fall_back: Callable[[], object] | None = None,
        drained: Callable[[], bool] | None = None,
        drain_s: float = 300.0,
    ) -> None:
        self.redis = redis
        self.namespace = namespace
        self.scope = scope
        self.keys = [lease_key(namespace, scope, g) for g in gpus]
        self.generation = generation
        self.period_s = period_s
        self.fall_back = fall_back
        self.drained = drained
        self.drain_s = drain_s
        self.holders: list[bytes | None] = []
        self.fell_back = False

    async def _tokens(self) -> list[bytes | None]:
        return list(await self.redis.mget(self.keys))

    async def start(self) -> None:
        """Record who holds each rank's GPU now (every PE has joined: ``init`` returned)."""
        self.holders = await self._tokens()
        missing = [r for r, t in enumerate(self.holders) if t is None]
        if missing:
            raise WorldBrokenError(f"NVSHMEM world {self.generation}: ranks {missing} hold no GPU lease")

    async def dead(self) -> list[int]:
        """Ranks whose executor is gone since :meth:`start` (lease released, lapsed or re-claimed)."""
        now = await self._tokens()
        return [r for r, (was, held) in enumerate(zip(self.holders, now, strict=True)) if held != was]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            dead = await self.dead()
            if dead:
                break
        gen = await next_generation(self.redis, self.namespace, self.scope, self.generation)
        if self.fall_back is not None:
            self.fall_back()
            self.fell_back = True
        log.error(
            "NVSHMEM world %d lost ranks %s: the box moves to generation %d; this executor serves over CUDA "
            "IPC until its tensors in the world's arena are released, then ends to join it",
            self.generation, dead, gen,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        while True:  # polled: the store has no event to wait on
            if self.drained is None or self.drained() or loop.time() >= deadline:
                break
            await asyncio.sleep(self.period_s)
        raise WorldBrokenError(f"NVSHMEM world {self.generation} lost ranks {dead} (box now at {gen})")

    async def stop(self) -> None:
        pass
