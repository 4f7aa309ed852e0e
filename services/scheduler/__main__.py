"""``python -m services.scheduler``: wire config, NATS, Redis, the policy and the core together."""

from __future__ import annotations

import asyncio

from libs.common.config import load_config
from libs.common.logs import setup_logging
from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis
from libs.common.runner import close_quietly, run_service
from libs.common.settings import common_settings
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects
from services.scheduler.config import SchedulerConfig
from services.scheduler.policy import get_policy
from services.scheduler.service import SchedulerService
from services.scheduler.state import SchedulerCore


async def main() -> None:
    common = common_settings()
    cfg = load_config(SchedulerConfig, "T2I_SCHEDULER_")
    log = setup_logging("scheduler", common.log_level)
    core = SchedulerCore(
        get_policy(cfg.policy, cfg.slack_s),
        heartbeat_timeout_s=cfg.heartbeat_timeout_s,
        max_node_retries=cfg.max_node_retries,
        max_restarts=cfg.max_restarts,
    )
    nc = await connect(common.nats_url, "scheduler")
    redis = connect_redis(common.redis_url)
    service = SchedulerService(
        nc=nc,
        redis=redis,
        subjects=Subjects(common.namespace),
        keys=Keys(common.namespace),
        core=core,
        cfg=cfg,
    )
    await service.start()
    slack = f", slack {cfg.slack_s:g}s" if cfg.policy == "fair" else ""
    log.info("scheduler ready (policy %s%s, namespace %s)", cfg.policy, slack, common.namespace)
    try:
        await run_service(*service.tasks())
    finally:
        await close_quietly(service.stop(), "service")
        await close_quietly(nc.drain(), "nats")
        await close_quietly(redis.aclose(), "redis")


if __name__ == "__main__":
    asyncio.run(main())
