"""``python -m services.registry``: wire config, NATS, Redis and the registry together."""

from __future__ import annotations

from contextlib import AsyncExitStack

from libs.common.config import load_config
from libs.common.logs import setup_logging
from libs.common.metrics import RegistryMetrics, serve_metrics
from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis
from libs.common.service import main, own
from libs.common.settings import common_settings
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects
from libs.workflow import catalog
from services.registry.config import RegistryConfig
from services.registry.service import RegistryService
from services.registry.store import WorkflowStore


async def build(stack: AsyncExitStack) -> RegistryService:
    common = common_settings()
    load_config(RegistryConfig, "T2I_REGISTRY_")
    setup_logging("registry", common.log_level)
    nc = await connect(common.nats_url, "registry")
    own(stack, nc.drain, "nats")
    redis = connect_redis(common.redis_url)
    own(stack, redis.aclose, "redis")
    metrics = RegistryMetrics()
    await serve_metrics(stack, metrics, host=common.metrics_host, port=common.metrics_port)
    return RegistryService(
        nc,
        WorkflowStore(redis, Keys(common.namespace)),
        catalog.signatures(),
        Subjects(common.namespace),
        metrics=metrics,
    )


if __name__ == "__main__":
    main(build)
