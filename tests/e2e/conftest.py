"""The catalog stack the catalog's end-to-end tests share (``test_catalog_e2e.py``,
``test_edits_e2e.py``): every family built once per session, and per module one stack of two
executors under a 1 MiB weight budget with every catalog workflow and LoRA registered. The other
e2e modules define a ``stack`` of their own, which overrides this one."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from libs.launcher.stack import Stack
from libs.models import families
from libs.workflow.spec import encode_spec
from tests.conftest import cleanup_namespace, free_port
from tests.support.catalog import BUDGET_MB, KEY


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    from libs.models.tiny_sd import build_lora

    root = tmp_path_factory.mktemp("catalog-models")
    built = families.build(root)
    # A second SD1.5 adapter, so warm executors switch between two different LoRAs.
    build_lora(root / "tiny-sd15", root / "loras" / "tiny-sd15-other.safetensors", seed=1)
    return root, built


@pytest.fixture(scope="session")
def catalog_models(built):
    return built[0]


@pytest.fixture(scope="module")
def stack(broker_urls, catalog_models, tmp_path_factory):
    nats_url, redis_url = broker_urls
    s = Stack(
        namespace="t" + uuid.uuid4().hex[:10],
        log_dir=tmp_path_factory.mktemp("logs"),
        model_root=catalog_models,
        gateway_port=free_port(),
        executors=2,
        api_keys=f"{KEY}=cat:admin",
        nats_url=nats_url,
        redis_url=redis_url,
        # No weights in the arena either: every layer beyond the budget is evicted, not parked.
        extra_env={"T2I_EXECUTOR_DEVICE_BUDGET_MB": str(BUDGET_MB), "T2I_EXECUTOR_ARENA_WEIGHTS": "0"},
    )
    s.start()
    try:
        for spec in families.workflows():
            status, body = s.http("POST", "/v1/workflows", json.loads(encode_spec(spec)), key=KEY)
            assert status == 201, (spec.name, body)
        loras = {**families.LORAS, "tiny-sd15-other": "loras/tiny-sd15-other.safetensors"}
        for name, path in loras.items():
            assert s.http("POST", "/v1/loras", {"name": name, "path": path}, key=KEY)[0] == 201
        yield s
    finally:
        s.stop()
        asyncio.run(cleanup_namespace(nats_url, redis_url, s.namespace))
