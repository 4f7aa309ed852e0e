"""A registry service running in the test's event loop, with a client, on the real NATS and Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from redis.asyncio import Redis

from libs.common.nats_conn import connect
from libs.common.registry_client import RegistryClient
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects
from libs.workflow import catalog
from services.registry.service import RegistryService
from services.registry.store import WorkflowStore


@dataclass
class RunningRegistry:
    service: RegistryService
    client: RegistryClient
    nc: Client
    subjects: Subjects


@asynccontextmanager
async def running_registry(
    common: Any, signatures: dict | None = None, client_timeout_s: float = 2.0
) -> AsyncIterator[RunningRegistry]:
    """``signatures``: the registry's own catalog (default: every installed ModelFn's)."""
    nc = await connect(common.nats_url, "test-registry")
    redis = Redis.from_url(common.redis_url)
    subjects = Subjects(common.namespace)
    own = catalog.signatures() if signatures is None else signatures
    service = RegistryService(nc, WorkflowStore(redis, Keys(common.namespace)), own, subjects)
    await service.start()
    try:
        yield RunningRegistry(service, RegistryClient(nc, subjects, timeout=client_timeout_s), nc, subjects)
    finally:
        await service.stop()
        await nc.close()
        await redis.aclose()
