"""``python -m services.scheduler``: wire config, NATS, Redis, the lease, the policy and the core
together, one reign at a time (``succession.py``: a scheduler that steps down builds itself anew
and waits as a standby, so a Redis blip under ``make run``, where nothing restarts a process, does
not leave the platform without a scheduler).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from contextlib import AsyncExitStack

from libs.common.config import load_config
from libs.common.logs import setup_logging
from libs.common.metrics import SchedulerMetrics, serve_metrics
from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis, connect_redis_sync
from libs.common.runner import run_service
from libs.common.service import own
from libs.common.settings import common_settings
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.deployment import Deployment
from services.scheduler.core.machine import SchedulerMachine
from services.scheduler.core.policy import get_policy
from services.scheduler.core.scheduling import SchedulerCore
from services.scheduler.replay import Recorder, record_path
from services.scheduler.shell.lease import Lease
from services.scheduler.shell.service import SchedulerService
from services.scheduler.shell.succession import Succession

log = logging.getLogger(__name__)


def build_machine(stack: AsyncExitStack, cfg: SchedulerConfig) -> SchedulerMachine:
    """The state machine one leadership runs (a fresh one per reign), its inbox recorded when
    ``cfg.record`` names a file (``T2I_SCHEDULER_RECORD``: replay.py)."""
    core = SchedulerCore(
        get_policy(cfg.policy, cfg.slack_s),
        heartbeat_timeout_s=cfg.heartbeat_timeout_s,
        max_node_retries=cfg.max_node_retries,
        max_restarts=cfg.max_restarts,
        node_time_limit_s=cfg.node_time_limit_s,
        node_time_factor=cfg.node_time_factor,
        deployment=Deployment(cfg.deployment),
    )
    machine = SchedulerMachine(core, cfg)
    if cfg.record:
        recorder = Recorder(machine, record_path(cfg.record))
        stack.callback(recorder.close)
    return machine


async def build(stack: AsyncExitStack) -> SchedulerService:
    common = common_settings()
    cfg = load_config(SchedulerConfig, "T2I_SCHEDULER_")
    setup_logging("scheduler", common.log_level)
    machine = build_machine(stack, cfg)
    nc = await connect(common.nats_url, "scheduler")
    own(stack, nc.drain, "nats")
    redis = connect_redis(common.redis_url)
    own(stack, redis.aclose, "redis")
    slack = f", slack {cfg.slack_s:g}s" if cfg.policy == "fair" else ""
    log.info(
        "scheduler configured (policy %s%s, deployment %s, namespace %s)",
        cfg.policy,
        slack,
        cfg.deployment,
        common.namespace,
    )
    metrics = SchedulerMetrics()
    await serve_metrics(stack, metrics, host=common.metrics_host, port=common.metrics_port)
    keys = Keys(common.namespace)
    # The keeper thread's own connection; one call never outlasts a third of the TTL.
    timeout_s = min(1.0, cfg.lease_ttl_s / 3)
    lease = Lease(
        lambda: connect_redis_sync(common.redis_url, timeout_s), keys, cfg.lease_ttl_s, cfg.lease_poll_s
    )
    return SchedulerService(
        metrics=metrics,
        lease=lease,
        nc=nc,
        redis=redis,
        subjects=Subjects(common.namespace),
        keys=keys,
        machine=machine,
        cfg=cfg,
    )


def tune_gc() -> None:
    """Fewer, not longer, pauses of the cyclic garbage collector.

    A full (generation 2) collection walks every tracked object, and the scheduler's are mostly the
    DAGs and node records of the requests in flight: ~300,000 objects at 600 requests in flight,
    and each full collection held the event loop for 0.1-0.75 s (measured with ``gc.callbacks``
    under bench/scale.py's 256-GPU load on two cores), the longest stalls the loop watchdog saw.
    Few of those objects are ever part of a cycle (a collection found a few hundred), so collecting
    young objects far less often costs little memory: generation 0 is collected after 50,000 net
    allocations instead of 700, which makes full collections far rarer: 19 to 1 in a quick
    256-GPU run, the worst lag 235-316 ms to 71-168 ms, dispatches +15-30% (docs/scheduling.md,
    "Event-loop stalls"). What exists at start-up (modules, classes, the config) is frozen out
    of every collection.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 10)


if __name__ == "__main__":
    tune_gc()
    asyncio.run(run_service(Succession(build).run()))
