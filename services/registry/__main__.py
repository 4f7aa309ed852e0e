"""``python -m services.registry``: wire config, NATS, Redis and the registry together."""

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
from libs.workflow import catalog
from services.registry.config import RegistryConfig
from services.registry.service import RegistryService
from services.registry.store import WorkflowStore


async def main() -> None:
    common = common_settings()
    load_config(RegistryConfig, "T2I_REGISTRY_")
    log = setup_logging("registry", common.log_level)
    nc = await connect(common.nats_url, "registry")
    redis = connect_redis(common.redis_url)
    service = RegistryService(
        nc, WorkflowStore(redis, Keys(common.namespace)), catalog.signatures(), Subjects(common.namespace)
    )
    await service.start()
    log.info("registry ready (namespace %s)", common.namespace)
    try:
        await run_service()
    finally:
        await close_quietly(service.stop(), "service")
        await close_quietly(nc.drain(), "nats")
        await close_quietly(redis.aclose(), "redis")


if __name__ == "__main__":
    asyncio.run(main())
