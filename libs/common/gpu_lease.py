"""One GPU per executor on a shared box, through a Redis lease (docs/deploy.md).

``docker compose up --scale executor=N`` cannot give each replica a different device (a
``count: 1`` reservation may hand every replica the same GPU), so compose gives every executor all
of the box's GPUs and each one *claims* one at start: it takes the lowest visible index whose key
``{ns}:gpu:{scope}:{gpu}`` it can ``SET NX PX``, keeps the key alive from that moment on (a refresh
every third of the TTL, started with the claim: the executor's start-up, torch and CUDA included,
may take longer than the TTL) and deletes it at exit. Executors refresh from a thread of their own
with its own Redis connection (``keeper_redis``), as the scheduler renews its lease: importing torch
and diffusers on a loaded box blocks the event loop for tens of seconds, and a refresh on the loop
would let the key lapse, so that a second executor could claim the same GPU. A crashed executor's key lapses after the TTL, so its GPU
is claimed again by the next one to start. Only the owner (a random token) can refresh or delete a
key: both are compare-and-act Lua scripts.

``scope`` names the box: executors of several boxes sharing one Redis each set their own
(``T2I_EXECUTOR_GPU_LEASE_SCOPE``), otherwise they would exclude each other's GPU indices.

Nothing here imports torch: the lease is taken, and ``CUDA_VISIBLE_DEVICES`` set, before CUDA is
initialised (it reads the variable once, at initialisation).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio import Redis

from libs.common.redis_conn import DELETE_IF_HELD, RENEW_IF_HELD
from libs.errors import T2IError
from libs.protocol.keys import Keys

log = logging.getLogger(__name__)

SCOPE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
GPU_ID = re.compile(r"^[A-Za-z0-9_.:/-]{1,128}$")  # an index, or a GPU-/MIG- UUID


class GpuLeaseError(T2IError):
    """No GPU could be claimed (all leased, or none visible), or a held lease was lost."""


def lease_key(namespace: str, scope: str, gpu: str) -> str:
    return Keys(namespace).gpu_lease(scope, gpu)


def visible_gpus(setting: str = "", env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids this process may use, in claim order.

    ``setting`` (``T2I_EXECUTOR_GPUS``): a count (``"4"``: indices 0-3) or a comma list of ids.
    Otherwise ``CUDA_VISIBLE_DEVICES`` when set, else the GPUs ``nvidia-smi -L`` lists, else the
    ``/dev/nvidiaN`` device files (what the NVIDIA container runtime mounts)."""
    env = os.environ if env is None else env
    raw = setting.strip()
    if not raw:
        raw = env.get("CUDA_VISIBLE_DEVICES", "").strip()
        if not raw and "CUDA_VISIBLE_DEVICES" in env:
            return []  # set and empty: CUDA sees no device
    if raw.isdigit() and "," not in raw and setting.strip():
        return [str(i) for i in range(int(raw))]
    if raw:
        ids = [x.strip() for x in raw.split(",") if x.strip()]
        bad = [x for x in ids if not GPU_ID.match(x)]
        if bad:
            raise GpuLeaseError(f"GPU ids must match {GPU_ID.pattern}: {bad}")
        if len(set(ids)) != len(ids):
            raise GpuLeaseError(f"GPU ids listed twice: {raw!r}")
        return ids
    return [str(i) for i in range(_count_devices())]


def _count_devices() -> int:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
            return sum(1 for line in out.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("nvidia-smi -L failed (%s); counting /dev/nvidiaN instead", e)
    return len([p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)])


class GpuLease:
    """A claimed GPU: :meth:`claim` it, :meth:`apply` it to the process, :meth:`run` to keep it,
    :meth:`release` at exit (also usable as the ``start``/``run``/``stop`` of a companion service).
    """

    def __init__(
        self,
        redis: Redis,
        namespace: str,
        gpus: Sequence[str],
        *,
        scope: str = "box",
        owner: str = "",
        ttl_s: float = 30.0,
        wait_s: float = 60.0,
        poll_s: float = 1.0,
        keeper_redis: Any = None,
    ) -> None:
        if not SCOPE.match(scope):
            raise GpuLeaseError(f"GPU lease scope {scope!r} must match {SCOPE.pattern}")
        if not ttl_s >= 1.0:
            raise GpuLeaseError(f"GPU lease TTL must be at least 1 s, got {ttl_s}")
        if wait_s < 0:
            raise GpuLeaseError(f"GPU lease wait must be >= 0 s, got {wait_s}")
        self.redis = redis
        self.namespace = namespace
        self.gpus = list(gpus)
        self.scope = scope
        # Random per claim: a restarted executor with the same id never mistakes its predecessor's
        # key for its own.
        self.token = f"{owner or 'executor'}/{secrets.token_hex(8)}"
        self.ttl_ms = int(ttl_s * 1000)
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.gpu: str | None = None
        self.index: int | None = None  # position of ``gpu`` among the visible ones
        self._refresh = redis.register_script(RENEW_IF_HELD)
        self._release = redis.register_script(DELETE_IF_HELD)
        self._keeper: asyncio.Future | None = None
        # A blocking client (connect_redis_sync): refresh from a thread, off the event loop.
        self.keeper_redis = keeper_redis
        self._stop_keeping = threading.Event()
        self._thread: threading.Thread | None = None
        self.refreshes = 0

    @property
    def key(self) -> str:
        if self.gpu is None:
            raise GpuLeaseError("no GPU claimed")
        return lease_key(self.namespace, self.scope, self.gpu)

    async def try_claim(self) -> str | None:
        """One pass over the visible GPUs, lowest first; the id claimed, or None (all leased)."""
        for i, gpu in enumerate(self.gpus):
            if await self.redis.set(
                lease_key(self.namespace, self.scope, gpu), self.token, nx=True, px=self.ttl_ms
            ):
                self.gpu, self.index = gpu, i
                return gpu
        return None

    async def claim(self) -> str:
        """Claim the lowest free GPU, waiting up to ``wait_s`` for one to be released or to lapse."""
        if not self.gpus:
            raise GpuLeaseError(
                "no GPU visible to claim (give the container GPUs, or set T2I_EXECUTOR_GPUS / "
                "CUDA_VISIBLE_DEVICES)"
            )
        deadline = time.monotonic() + self.wait_s
        while True:
            gpu = await self.try_claim()
            if gpu is not None:
                log.info("claimed GPU %s (scope %s) with a %d ms lease", gpu, self.scope, self.ttl_ms)
                self._start_keeping()
                return gpu
            if time.monotonic() >= deadline:
                raise GpuLeaseError(
                    f"all {len(self.gpus)} GPUs of scope {self.scope!r} are leased by other executors "
                    f"(waited {self.wait_s:g} s): run at most one executor per GPU"
                )
            await asyncio.sleep(self.poll_s)

    def apply(self, device: str, env: dict[str, str] | None = None, *, narrow: bool = True) -> str:
        """Point this process at the claimed GPU: ``CUDA_VISIBLE_DEVICES`` = its id, and the device
        string to use (``cuda``: the only one now visible). If CUDA was already initialised in this
        process (too late for the variable), or without ``narrow`` (the CUDA IPC and NVSHMEM data
        planes: a peer's GPU must stay visible to map its memory), the device is ``cuda:<index>``
        instead and every GPU stays visible. A ``cpu``
        device stays ``cpu``: a CPU executor standing in for a GPU one (compose on a box without
        GPUs, ``T2I_EXECUTOR_GPUS=N``) holds its lease exactly as the GPU's executor would."""
        if self.gpu is None or self.index is None:
            raise GpuLeaseError("no GPU claimed")
        if device == "cpu":
            return "cpu"
        if not device.startswith("cuda"):
            raise GpuLeaseError(f"a GPU lease needs a cuda (or a stand-in cpu) device, not {device!r}")
        env = os.environ if env is None else env
        if not narrow:
            return f"cuda:{self.index}"
        if _cuda_initialised():
            log.warning("CUDA was initialised before the GPU lease; using device cuda:%d", self.index)
            return f"cuda:{self.index}"
        env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return "cuda"

    async def refresh(self) -> bool:
        """Extend the lease; False when it is no longer ours (it lapsed and another claimed it)."""
        if await self._refresh(keys=[self.key], args=[self.token, self.ttl_ms]):
            return True
        # Lapsed (Redis unreachable for a TTL) but free: take it again rather than give up the GPU.
        return bool(await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms))

    async def start(self) -> None:
        if self.gpu is None:
            await self.claim()

    async def run(self) -> None:
        """Await the refreshing (started by :meth:`claim`) until cancelled; raises
        :class:`GpuLeaseError` when the lease was lost (the executor then stops: it may be sharing a
        GPU with another)."""
        if self._keeper is None:
            self._start_keeping()
        assert self._keeper is not None
        await asyncio.shield(self._keeper)  # cancelling run() leaves the refreshing to release()

    def _start_keeping(self) -> None:
        if self.keeper_redis is None:
            self._keeper = asyncio.ensure_future(self._keep())
            return
        loop = asyncio.get_running_loop()
        self._keeper = loop.create_future()  # fails when the thread finds the lease lost
        self._stop_keeping.clear()
        self._thread = threading.Thread(
            target=self._keep_in_thread, args=(loop, self._keeper), name=f"gpu-lease-{self.gpu}", daemon=True
        )
        self._thread.start()

    def _keep_in_thread(self, loop: asyncio.AbstractEventLoop, lost: asyncio.Future) -> None:
        """:meth:`_keep` on a thread with a blocking connection: a stalled event loop cannot starve it."""
        r = self.keeper_redis
        renew = r.register_script(RENEW_IF_HELD)
        period = self.ttl_ms / 3000
        while not self._stop_keeping.wait(period):
            try:
                ok = bool(renew(keys=[self.key], args=[self.token, self.ttl_ms])) or bool(
                    r.set(self.key, self.token, nx=True, px=self.ttl_ms)
                )  # lapsed (Redis away for a TTL) but free: take it again
            except Exception as e:  # noqa: BLE001 - Redis briefly away: the TTL covers a few misses
                log.warning("GPU lease refresh failed: %s", e)
                continue
            if not ok:
                error = GpuLeaseError(f"lost the lease of GPU {self.gpu} (another executor holds it)")
                loop.call_soon_threadsafe(_fail, lost, error)
                return
            self.refreshes += 1

    async def _keep(self) -> None:
        period = self.ttl_ms / 3000
        while True:
            await asyncio.sleep(period)
            try:
                ok = await self.refresh()
            except Exception as e:  # noqa: BLE001 - Redis briefly away: the TTL covers a few misses
                log.warning("GPU lease refresh failed: %s", e)
                continue
            if not ok:
                raise GpuLeaseError(f"lost the lease of GPU {self.gpu} (another executor holds it)")
            self.refreshes += 1

    async def release(self) -> bool:
        """Delete the lease if it is still ours; True when it was."""
        if self.gpu is None:
            return False
        if self._thread is not None:
            self._stop_keeping.set()
            await asyncio.to_thread(self._thread.join)  # at most one refresh's socket timeout
            self._thread = None
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None
        released = bool(await self._release(keys=[self.key], args=[self.token]))
        log.info("released GPU %s" if released else "GPU %s: lease already gone", self.gpu)
        return released

    async def stop(self) -> None:
        """Nothing: :meth:`release` is the owner's to call once the GPU is no longer in use (after
        the executor stopped), not when the refreshing stops."""


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _cuda_initialised() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())
