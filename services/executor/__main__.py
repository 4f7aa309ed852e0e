"""``python -m services.executor``: one executor process (one accelerator)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from pathlib import Path

from libs.common.config import load_config
from libs.common.jetstream import ensure_images_bucket
from libs.common.logs import setup_logging
from libs.common.nats_conn import connect
from libs.common.runner import close_quietly, run_service
from libs.common.settings import CommonSettings, common_settings
from libs.protocol.subjects import Subjects
from libs.workflow import catalog
from services.executor.config import ExecutorConfig
from services.executor.service import ExecutorService


def _safe_id(raw: str) -> str:
    # The id is a NATS subject token and part of a shared-memory segment name.
    return re.sub(r"[^A-Za-z0-9_-]", "-", raw)[:64]


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


async def main() -> None:
    common = common_settings()
    cfg = load_config(ExecutorConfig, "T2I_EXECUTOR_")
    if cfg.mode == "sim":
        await run_simulated(common, cfg)
    elif cfg.mode == "real":
        await run_real(common, cfg)
    else:
        raise SystemExit(f"T2I_EXECUTOR_MODE must be 'real' or 'sim', not {cfg.mode!r}")


async def run_real(common: CommonSettings, cfg: ExecutorConfig) -> None:
    executor_id = _safe_id(cfg.id or f"exec-{socket.gethostname()}-{os.getpid()}")
    log = setup_logging(f"executor[{executor_id}]", common.log_level)
    t0 = time.perf_counter()
    import torch  # heavy: after logging is up, so the start-up cost is visible

    from libs.dataplane.store import TensorStore
    from libs.dataplane.transport import make_transport
    from services.executor.runtime import ModelCache, NodeRunner

    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("T2I_DEVICE", cfg.device)
    transport = make_transport(
        cfg.transport,
        namespace=common.namespace,
        executor_id=executor_id,
        capacity=_pow2_at_least(cfg.arena_mb << 20),
        host=cfg.host,
    )
    store = TensorStore(executor_id, transport, alloc_timeout=cfg.alloc_timeout_s)
    runner = NodeRunner(store, ModelCache(Path(cfg.model_root), cfg.device), cfg.device)
    nc = await connect(common.nats_url, f"executor-{executor_id}")
    subjects = Subjects(common.namespace)
    images = await ensure_images_bucket(nc.jetstream(), subjects)
    kind = "cuda" if cfg.device.startswith("cuda") else "cpu"
    service = ExecutorService(
        executor_id=executor_id,
        kind=kind,
        nc=nc,
        subjects=subjects,
        store=store,
        runner=runner,
        images=images,
        fns=catalog.names(),
        heartbeat_s=cfg.heartbeat_s,
    )
    await service.start()
    log.info(
        "executor ready in %.1fs: %s, %d threads, %s arena of %d MiB at %s",
        time.perf_counter() - t0,
        cfg.device,
        cfg.threads,
        transport.kind,
        transport.arena.capacity >> 20,
        transport.address,
    )
    try:
        await run_service(service.heartbeat_loop())
    finally:
        await close_quietly(service.stop(), "service")
        await close_quietly(nc.drain(), "nats")
        del runner, store
        transport.close()


async def run_simulated(common: CommonSettings, cfg: ExecutorConfig) -> None:
    """``sim_count`` simulated executors in this process, on one NATS connection, without torch."""
    from libs.sim.profile import load_profile
    from services.executor.sim import SimRunner, SimStore

    base = _safe_id(cfg.id or f"sim-{socket.gethostname()}-{os.getpid()}")
    log = setup_logging(f"executor[{base}]", common.log_level)
    profile = load_profile(cfg.sim_profile)
    nc = await connect(common.nats_url, f"executor-{base}")
    subjects = Subjects(common.namespace)
    images = await ensure_images_bucket(nc.jetstream(), subjects)
    services = []
    for i in range(cfg.sim_count):
        eid = f"{base}-{i}" if cfg.sim_count > 1 else base
        store = SimStore(eid, _pow2_at_least(cfg.arena_mb << 20))
        service = ExecutorService(
            executor_id=eid,
            kind="sim",
            nc=nc,
            subjects=subjects,
            store=store,
            runner=SimRunner(profile, store, cfg.sim_time_scale),
            images=images,
            fns=catalog.names(),
            heartbeat_s=cfg.heartbeat_s,
        )
        await service.start()
        services.append(service)
    log.info(
        "executor ready: %d simulated %s executors (profile %s, time scale %g)",
        cfg.sim_count,
        profile.device,
        profile.name,
        cfg.sim_time_scale,
    )
    try:
        await run_service(*(s.heartbeat_loop() for s in services))
    finally:
        for s in services:
            await close_quietly(s.stop(), "service")
        await close_quietly(nc.drain(), "nats")


if __name__ == "__main__":
    asyncio.run(main())
