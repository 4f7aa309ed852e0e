"""``python -m services.executor``: one executor process (one accelerator), or many simulated ones."""

from __future__ import annotations

import os
import re
import socket
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from libs.common.config import load_config
from libs.common.jetstream import ensure_images_bucket
from libs.common.logs import setup_logging
from libs.common.metrics import ExecutorMetrics, serve_metrics
from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis, connect_redis_sync
from libs.common.service import main, own
from libs.common.settings import common_settings
from libs.protocol.subjects import Subjects
from libs.workflow import catalog
from services.executor.advertise import Advertiser, WithCompanions
from services.executor.config import DataplaneSettings, ExecutorConfig
from services.executor.service import ExecutorGroup, ExecutorService


def _safe_id(raw: str) -> str:
    # The id is a NATS subject token and part of a shared-memory segment name.
    return re.sub(r"[^A-Za-z0-9_-]", "-", raw)[:64]


#: Transports whose arena is device memory that peers pull from GPU to GPU.
DEVICE_TRANSPORTS = ("cuda_ipc", "nvshmem")


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def granularity(cfg: ExecutorConfig) -> str:
    """How cached weights are kept at start: ``T2I_EXECUTOR_CACHE_MODE``, else ``layer`` until the
    scheduler's first dispatch names its deployment mode (``ExecutorService.follow_deployment``;
    docs/scheduling.md, "Deployment modes")."""
    from libs.dataplane.weights import cache_granularity

    try:
        return cache_granularity(cfg.cache_mode)
    except ValueError as e:
        raise SystemExit(f"T2I_EXECUTOR_CACHE_MODE: {e}") from None


def transport_kind(cfg: ExecutorConfig) -> str:
    """``T2I_EXECUTOR_TRANSPORT``, with ``auto`` resolved: a device arena and CUDA IPC on a CUDA
    device, shared memory on the CPU."""
    kinds = ("auto", "shm", "tcp", "cuda_ipc", "nvshmem")
    if cfg.transport not in kinds:
        raise SystemExit(f"T2I_EXECUTOR_TRANSPORT must be one of {', '.join(kinds)}, not {cfg.transport!r}")
    if cfg.transport == "auto":
        return "cuda_ipc" if cfg.device.startswith("cuda") else "shm"
    if cfg.transport in ("cuda_ipc", "nvshmem") and not cfg.device.startswith("cuda"):
        raise SystemExit(f"T2I_EXECUTOR_TRANSPORT={cfg.transport} needs a cuda device, not {cfg.device!r}")
    return cfg.transport


async def claim_gpu(stack: AsyncExitStack, cfg: ExecutorConfig, executor_id: str, *, narrow: bool = True):
    """Claim this executor's GPU (``T2I_EXECUTOR_GPU_LEASE``) and point CUDA at it, before torch
    starts; released when the process exits, after the executor stopped. ``narrow``: make it the
    only visible GPU (not for the device-to-device transports, whose peers' GPUs must stay visible)."""
    from libs.common.gpu_lease import GpuLease, GpuLeaseError, visible_gpus

    common = common_settings()
    redis = connect_redis(common.redis_url, max_connections=2)
    own(stack, redis.aclose, "redis")
    # Refreshed from a thread with this connection: torch's import may block the loop for longer
    # than the TTL (libs/common/gpu_lease.py).
    keeper = connect_redis_sync(common.redis_url, min(1.0, cfg.gpu_lease_ttl_s / 3))
    stack.callback(keeper.close)
    try:
        lease = GpuLease(
            redis,
            common.namespace,
            visible_gpus(cfg.gpus),
            scope=cfg.gpu_lease_scope,
            owner=executor_id,
            ttl_s=cfg.gpu_lease_ttl_s,
            wait_s=cfg.gpu_lease_wait_s,
            keeper_redis=keeper,
        )
        await lease.claim()
        own(stack, lease.release, "gpu lease")
        cfg.device = lease.apply(cfg.device, narrow=narrow)
    except GpuLeaseError as e:
        raise SystemExit(f"T2I_EXECUTOR_GPU_LEASE: {e}") from None
    return lease


async def nvshmem_transport(
    stack: AsyncExitStack, cfg: ExecutorConfig, common: Any, lease: Any, executor_id: str
) -> tuple[Any, Any]:
    """This executor's PE of the box's NVSHMEM world (``T2I_EXECUTOR_TRANSPORT=nvshmem``): its rank is
    the index of the GPU it leased, the world's size ``T2I_EXECUTOR_NVSHMEM_WORLD`` (fixed for the
    world's life), the unique id exchanged through Redis under the box's current generation (at least
    ``T2I_EXECUTOR_NVSHMEM_GENERATION``; libs/dataplane/transport/bootstrap.py). Either every PE joins
    within ``T2I_EXECUTOR_NVSHMEM_JOIN_S`` or none calls ``init``; a world that cannot form falls back
    to CUDA IPC. Returns the transport (the world's with a CUDA IPC fall-back) and the watch that
    switches to the fall-back when a PE of the world dies and ends the executor once drained (None
    when the world did not form): services/executor/world.py."""
    from libs.dataplane.transport.bootstrap import redis_uid_exchange, world_key
    from libs.dataplane.transport.fallback import FallbackTransport
    from libs.dataplane.transport.ipc import CudaIpcTransport
    from libs.dataplane.transport.nvshmem import NvshmemTransport
    from services.executor.world import WorldWatch, current_generation, open_world

    if lease is None or lease.index is None:
        raise SystemExit(
            "T2I_EXECUTOR_TRANSPORT=nvshmem: the rank is the leased GPU's index; set T2I_EXECUTOR_GPU_LEASE=true"
        )
    if not 0 < cfg.nvshmem_world <= len(lease.gpus) or lease.index >= cfg.nvshmem_world:
        raise SystemExit(
            f"T2I_EXECUTOR_NVSHMEM_WORLD={cfg.nvshmem_world}: must be the number of the box's executors, at "
            f"most its {len(lease.gpus)} GPUs (this one leased GPU index {lease.index})"
        )
    scope = cfg.gpu_lease_scope
    generation = await current_generation(lease.redis, common.namespace, scope, cfg.nvshmem_generation)
    client = connect_redis_sync(common.redis_url, 5.0)
    stack.callback(client.close)
    capacity = _pow2_at_least(cfg.arena_mb << 20)
    exchange = redis_uid_exchange(
        client,
        world_key(common.namespace, scope, generation),
        nranks=cfg.nvshmem_world,
        timeout_s=cfg.nvshmem_join_s,
    )
    world, formed = open_world(
        lambda: NvshmemTransport(
            rank=lease.index, nranks=cfg.nvshmem_world, capacity=capacity, exchange_uid=exchange,
            device_index=int(cfg.device.partition(":")[2] or 0),
        ),
        lambda: CudaIpcTransport(common.namespace, executor_id, capacity, device=cfg.device),
        f"NVSHMEM world {generation} of box {scope!r}",
    )  # fmt: skip
    if not formed:
        return world, None
    # Every PE also holds a CUDA IPC arena: when a PE of the world dies, the survivors go on over it.
    transport = FallbackTransport(
        world, CudaIpcTransport(common.namespace, executor_id, capacity, device=cfg.device)
    )
    gpus = lease.gpus[: cfg.nvshmem_world]
    watch = WorldWatch(
        lease.redis,
        common.namespace,
        scope,
        gpus,
        generation,
        fall_back=transport.fall_back,
        drain_s=cfg.nvshmem_drain_s,
    )
    return transport, watch


def advertiser(nc, cfg: ExecutorConfig, namespace: str, executor_id: str) -> Advertiser:
    return Advertiser(nc, namespace, executor_id, catalog.signatures(), ttl_s=cfg.advertise_ttl_s)


def _library_logs_to_root() -> None:
    """transformers and diffusers log through stderr handlers of their own, in plain text: hand
    their records to the root handler instead, so they are JSON lines like every other."""
    import importlib

    for name in ("transformers.utils.logging", "diffusers.utils.logging"):
        try:
            lib = importlib.import_module(name)
            lib.disable_default_handler()
            lib.enable_propagation()
        except (ImportError, AttributeError):  # not installed, or another API: their own format
            pass


async def _metrics(stack: AsyncExitStack, common) -> ExecutorMetrics:
    """The process's metrics, served on ``T2I_METRICS_PORT`` (docs/observability.md)."""
    metrics = ExecutorMetrics()
    await serve_metrics(stack, metrics, host=common.metrics_host, port=common.metrics_port)
    return metrics


async def build(stack: AsyncExitStack) -> WithCompanions:
    cfg = load_config(ExecutorConfig, "T2I_EXECUTOR_")
    if cfg.mode == "sim":
        return await build_simulated(stack, cfg)
    if cfg.mode == "real":
        return await build_real(stack, cfg)
    raise SystemExit(f"T2I_EXECUTOR_MODE must be 'real' or 'sim', not {cfg.mode!r}")


def dataplane_token() -> str:
    """The tcp data plane's shared secret (``T2I_DATAPLANE_TOKEN`` or ``_TOKEN_FILE``)."""
    try:
        return load_config(DataplaneSettings, "T2I_DATAPLANE_").secret()
    except ValueError as e:
        raise SystemExit(str(e)) from None


async def build_real(stack: AsyncExitStack, cfg: ExecutorConfig) -> WithCompanions:
    common = common_settings()
    executor_id = _safe_id(cfg.id or f"exec-{socket.gethostname()}-{os.getpid()}")
    setup_logging(f"executor[{executor_id}]", common.log_level)
    t0 = time.perf_counter()
    kind = transport_kind(cfg)
    lease = (
        await claim_gpu(stack, cfg, executor_id, narrow=kind not in DEVICE_TRANSPORTS)
        if cfg.gpu_lease
        else None
    )
    import torch  # heavy: after logging is up, so the start-up cost is visible

    _library_logs_to_root()

    from libs.dataplane.hosttier import HostTier
    from libs.dataplane.loader import Loader
    from libs.dataplane.store import TensorStore
    from libs.dataplane.transport import make_transport
    from services.executor.memory import default_host_tier_mb
    from services.executor.runtime import ModelCache, NodeRunner, parse_dtypes

    torch.set_num_threads(cfg.threads)
    if cfg.device.startswith("cuda:"):  # every GPU visible (a device transport): ours is current
        torch.cuda.set_device(torch.device(cfg.device))
    watch = None
    if kind == "nvshmem":
        transport, watch = await nvshmem_transport(stack, cfg, common, lease, executor_id)
    else:
        transport = make_transport(
            kind,
            namespace=common.namespace,
            executor_id=executor_id,
            capacity=_pow2_at_least(cfg.arena_mb << 20),
            host=cfg.host,
            token=dataplane_token(),
            timeout=cfg.dataplane_timeout_s,
            max_connections=cfg.dataplane_max_connections,
            device=cfg.device,
        )
    stack.callback(transport.close)  # last: after the service stopped using the arena
    store = TensorStore(executor_id, transport, alloc_timeout=cfg.alloc_timeout_s)
    if watch is not None:  # the world broken, the executor ends once none of its tensors is left in it
        watch.drained = lambda: store.held_in(transport.primary) == 0
    tier = None
    if cfg.host_tier_mb < 0:
        cfg.host_tier_mb = default_host_tier_mb(cfg.host_tier_dir)
    if cfg.host_tier_mb > 0:
        # One host copy per box: every executor with the same tier name shares it (never destroyed
        # here: the others still use it; a crashed executor's holds lapse with its locks).
        tier = HostTier(
            cfg.host_tier or f"{common.namespace}-host",
            cfg.host_tier_mb << 20,
            root=cfg.host_tier_dir,
            block_access="read" if cfg.device.startswith("cuda") else "copy",
        )
        stack.callback(tier.close)
    loader = Loader(tier, disk_threads=cfg.load_threads, chunk_bytes=cfg.load_chunk_mb << 20)
    stack.callback(loader.close)
    if not 0.0 <= cfg.arena_weights <= 1.0:
        raise ValueError(f"T2I_EXECUTOR_ARENA_WEIGHTS must be in [0, 1], got {cfg.arena_weights}")
    models = ModelCache(
        Path(cfg.model_root),
        cfg.device,
        loader,
        parse_dtypes(cfg.dtypes),
        budget=max(0, cfg.device_budget_mb) << 20,
        pool=(cfg.device_pool_mb << 20) if cfg.device_pool_mb > 0 and cfg.device.startswith("cuda") else None,
        arena=transport.arena,
        arena_budget=int(cfg.arena_weights * transport.arena.capacity),
        granularity=granularity(cfg),
    )
    runner = NodeRunner(store, models, cfg.device)
    nc = await connect(common.nats_url, f"executor-{executor_id}")
    own(stack, nc.drain, "nats")
    subjects = Subjects(common.namespace)
    service = ExecutorService(
        executor_id=executor_id,
        kind="cuda" if cfg.device.startswith("cuda") else "cpu",
        nc=nc,
        subjects=subjects,
        store=store,
        runner=runner,
        images=await ensure_images_bucket(nc.jetstream(), subjects),
        fns=catalog.names(),
        heartbeat_s=cfg.heartbeat_s,
        node_timeout_s=cfg.node_timeout_s,
        attempt_ttl_s=cfg.attempt_ttl_s,
        reconcile_grace_s=cfg.reconcile_grace_s,
        metrics=await _metrics(stack, common),
        gpu=lease.gpu if lease is not None and lease.gpu is not None else "",
        follow_deployment=not cfg.cache_mode,
    )
    ready = (
        f"executor ready in {time.perf_counter() - t0:.1f}s: {cfg.device}, {cfg.threads} threads, "
        f"{transport.kind} arena of {transport.arena.capacity >> 20} MiB at {transport.address}, "
        + (f"host tier {tier.name!r} of {cfg.host_tier_mb} MiB" if tier is not None else "no host tier")
        + (f", weights budget {cfg.device_budget_mb} MiB" if cfg.device_budget_mb > 0 else "")
        + f", weights cached by {models.weights.policy.granularity}"
        + (f", GPU {lease.gpu} leased" if lease is not None else "")
    )
    companions = [
        advertiser(nc, cfg, common.namespace, executor_id),
        *([lease] if lease else []),
        *([watch] if watch else []),
    ]
    return WithCompanions(ExecutorGroup([service], ready), companions)


async def build_simulated(stack: AsyncExitStack, cfg: ExecutorConfig) -> WithCompanions:
    """``sim_count`` simulated executors in this process, on one NATS connection, without torch."""
    from libs.sim.profile import load_profile
    from services.executor.sim import SimRunner, SimStore

    common = common_settings()
    base = _safe_id(cfg.id or f"sim-{socket.gethostname()}-{os.getpid()}")
    setup_logging(f"executor[{base}]", common.log_level)
    profile = load_profile(cfg.sim_profile)
    cache = granularity(cfg)
    nc = await connect(common.nats_url, f"executor-{base}")
    own(stack, nc.drain, "nats")
    subjects = Subjects(common.namespace)
    images = await ensure_images_bucket(nc.jetstream(), subjects)
    members = []
    metrics = await _metrics(stack, common)  # one endpoint for the process: labelled by executor
    for i in range(cfg.sim_count):
        eid = f"{base}-{i}" if cfg.sim_count > 1 else base
        store = SimStore(eid, _pow2_at_least(cfg.arena_mb << 20))
        members.append(
            ExecutorService(
                executor_id=eid,
                kind="sim",
                nc=nc,
                subjects=subjects,
                store=store,
                runner=SimRunner(profile, store, cfg.sim_time_scale, granularity=cache),
                images=images,
                fns=catalog.names(),
                heartbeat_s=cfg.heartbeat_s,
                node_timeout_s=cfg.node_timeout_s,
                attempt_ttl_s=cfg.attempt_ttl_s,
                reconcile_grace_s=cfg.reconcile_grace_s,
                metrics=metrics,
                follow_deployment=not cfg.cache_mode,
            )
        )
    ready = (
        f"executor ready: {cfg.sim_count} simulated {profile.device} executors "
        f"(profile {profile.name}, time scale {cfg.sim_time_scale:g}, weights cached by {cache})"
    )
    return WithCompanions(ExecutorGroup(members, ready), [advertiser(nc, cfg, common.namespace, base)])


if __name__ == "__main__":
    main(build)
