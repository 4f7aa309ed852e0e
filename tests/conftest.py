"""Fixtures: real NATS and Redis (started if none answers), isolated per test by namespace.

Every test that touches the bus or Redis gets a fresh namespace (``t`` + 10 hex digits): all its
subjects, streams, buckets and keys carry it, and teardown deletes them, so parallel or repeated
runs never see each other's data.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from libs.common.settings import CommonSettings
from libs.launcher import brokers

NATS_URL = os.environ.get("T2I_TEST_NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("T2I_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests are skipped, with the reason shown, where there is no CUDA device."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords or "nvshmem" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def broker_urls(tmp_path_factory):
    started = brokers.ensure_brokers(
        NATS_URL, REDIS_URL, tmp_path_factory.mktemp("brokers"), log=lambda *_: None
    )
    yield NATS_URL, REDIS_URL
    brokers.stop(started)


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
async def common(broker_urls, namespace):
    """Common settings for an in-process service, and cleanup of everything the namespace made."""
    nats_url, redis_url = broker_urls
    yield CommonSettings(nats_url=nats_url, redis_url=redis_url, namespace=namespace)
    await cleanup_namespace(nats_url, redis_url, namespace)


async def cleanup_namespace(nats_url: str, redis_url: str, namespace: str) -> None:
    import nats
    from redis.asyncio import Redis

    from libs.protocol.keys import Keys
    from libs.protocol.subjects import Subjects

    redis = Redis.from_url(redis_url)
    try:
        keys = [k async for k in redis.scan_iter(match=Keys(namespace).pattern(), count=1000)]
        if keys:
            await redis.delete(*keys)
    finally:
        await redis.aclose()
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        subjects = Subjects(namespace)
        for stream in (subjects.intake_stream, f"OBJ_{subjects.images_bucket}"):
            try:
                await js.delete_stream(stream)
            except Exception:  # noqa: BLE001 - not created by this test
                pass
    finally:
        await nc.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """The tiny-flux components, built once per session from configs with random weights."""
    from libs.models.tiny_flux import build_flux

    root = tmp_path_factory.mktemp("models")
    build_flux(root / "tiny-flux", preset="tiny")
    return root


@pytest.fixture
def loader():
    """A loader with no host tier (checkpoints read from disk), closed after the test."""
    from libs.dataplane.loader import Loader

    with Loader() as loader:
        yield loader


@pytest.fixture
def one_torch_thread():
    """Pin torch to one thread for a test (the thread count changes the bits of CPU kernels)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
