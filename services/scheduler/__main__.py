"""``python -m services.scheduler``: wire config, NATS, Redis, the policy and the core together.

A scheduler that loses its lease (Redis away for longer than the lease, another took over) steps
down: its ``run`` raises :class:`LeaseLost`. The process does not exit then; it builds itself anew
(fresh connections, an empty core: what it knew may be stale) and waits as a standby, so a Redis
blip under ``make run``, where nothing restarts a process, does not leave the platform without a
scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from libs.common.config import load_config
from libs.common.logs import setup_logging
from libs.common.metrics import SchedulerMetrics, serve_metrics
from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis
from libs.common.service import own, serve
from libs.common.settings import common_settings
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.deployment import Deployment
from services.scheduler.lease import LeaseLost
from services.scheduler.policy import get_policy
from services.scheduler.service import SchedulerService

log = logging.getLogger(__name__)


async def build(stack: AsyncExitStack) -> SchedulerService:
    common = common_settings()
    cfg = load_config(SchedulerConfig, "T2I_SCHEDULER_")
    setup_logging("scheduler", common.log_level)
    core = SchedulerCore(
        get_policy(cfg.policy, cfg.slack_s),
        heartbeat_timeout_s=cfg.heartbeat_timeout_s,
        max_node_retries=cfg.max_node_retries,
        max_restarts=cfg.max_restarts,
        node_time_limit_s=cfg.node_time_limit_s,
        node_time_factor=cfg.node_time_factor,
        deployment=Deployment(cfg.deployment),
    )
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
    return SchedulerService(
        metrics=metrics,
        nc=nc,
        redis=redis,
        subjects=Subjects(common.namespace),
        keys=Keys(common.namespace),
        core=core,
        cfg=cfg,
    )


async def serve_again_after_stepping_down() -> None:
    """Serve; after stepping down, serve again as a standby. Any other end is the process's end."""
    while True:
        try:
            await serve(build)
            return  # a stop signal
        except RuntimeError as e:
            if not isinstance(e.__cause__, LeaseLost):
                raise
            log.warning("stepped down (%s): starting again as a standby", e.__cause__)
        await asyncio.sleep(1.0)


if __name__ == "__main__":
    asyncio.run(serve_again_after_stepping_down())
