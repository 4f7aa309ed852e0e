"""``python -m services.scheduler``: wire config, NATS, Redis, the policy and the core together."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

from libs.common.config import load_config
from libs.common.logs import setup_logging
from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis
from libs.common.service import main, own
from libs.common.settings import common_settings
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
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
    )
    nc = await connect(common.nats_url, "scheduler")
    own(stack, nc.drain, "nats")
    redis = connect_redis(common.redis_url)
    own(stack, redis.aclose, "redis")
    slack = f", slack {cfg.slack_s:g}s" if cfg.policy == "fair" else ""
    log.info("scheduler configured (policy %s%s, namespace %s)", cfg.policy, slack, common.namespace)
    return SchedulerService(
        nc=nc,
        redis=redis,
        subjects=Subjects(common.namespace),
        keys=Keys(common.namespace),
        core=core,
        cfg=cfg,
    )


if __name__ == "__main__":
    main(build)
