"""The loading path through the executor's model cache: the box's host tier means a checkpoint is
read from disk once for every executor process of the box, and a model dropped by an executor and
needed again comes from host memory; the load reports which tier it used, which is what the
scheduler estimates and charges by."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from libs.dataplane.hosttier import HostTier
from libs.dataplane.loader import Loader
from services.executor.runtime import ModelCache

# One executor process: load the tiny Flux transformer through a model cache over the shared tier,
# print how it was loaded and a checksum of its weights.
LOAD = """
import json, sys
from pathlib import Path
from libs.dataplane.hosttier import HostTier
from libs.dataplane.loader import Loader
from services.executor.runtime import ModelCache
tier = HostTier(sys.argv[2], 1 << 30)
with Loader(tier) as loader:
    models = ModelCache(Path(sys.argv[1]), "cpu", loader)
    comps, load = models.components("flux.transformer", "tiny-flux")
    total = float(sum(p.double().sum() for p in comps["transformer"].parameters()))
    print(json.dumps({"tier": load.tier, "disk_bytes": load.disk_bytes, "sum": total}))
"""


@pytest.fixture
def tier_name():
    name = "test-" + uuid.uuid4().hex[:10]
    yield name
    HostTier.destroy(name)


def load_in_a_process(root: Path, tier: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(root), tier],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_executor_processes_of_a_box_read_a_checkpoint_from_disk_once(tiny_models: Path, tier_name: str):
    first = load_in_a_process(tiny_models, tier_name)
    second = load_in_a_process(tiny_models, tier_name)
    assert first["tier"] == "disk" and first["disk_bytes"] > 0
    assert second["tier"] == "host" and second["disk_bytes"] == 0
    assert second["sum"] == first["sum"]
    stats = HostTier(tier_name, 1 << 30).stats()
    assert stats["fills"] == 1 and stats["hits"] >= 1


def test_a_model_dropped_by_an_executor_and_needed_again_comes_from_the_host_tier(
    tiny_models: Path, tier_name: str
):
    tier = HostTier(tier_name, 1 << 30)
    with Loader(tier) as loader:
        first = ModelCache(tiny_models, "cpu", loader)
        comps, load = first.components("flux.transformer", "tiny-flux")
        assert load.tier == "disk" and load.disk_bytes > 0
        weights = {k: v.clone() for k, v in comps["transformer"].state_dict().items()}
        del first, comps  # the executor drops the model (eviction)
        again = ModelCache(tiny_models, "cpu", loader)
        comps, load = again.components("flux.transformer", "tiny-flux")
        assert load.tier == "host" and load.disk_bytes == 0
        for name, value in comps["transformer"].state_dict().items():
            assert torch.equal(value, weights[name]), name
        # The heartbeat's view: the model's bytes are in the box's host tier, with counters.
        assert [k.encode() for k in again.host_resident()] == ["flux.transformer|tiny-flux"]
        assert again.host_stats()["hits"] >= 1
    tier.close()


def test_the_component_dtype_is_configured_per_model(tiny_models: Path):
    from services.executor.runtime import parse_dtypes

    with Loader() as loader:
        models = ModelCache(tiny_models, "cpu", loader, parse_dtypes("tiny-flux=bfloat16"))
        comps, _ = models.components("flux.transformer", "tiny-flux")
        assert {p.dtype for p in comps["transformer"].parameters()} == {torch.bfloat16}
        plain = ModelCache(tiny_models, "cpu", loader)
        comps, _ = plain.components("flux.transformer", "tiny-flux")
        assert {p.dtype for p in comps["transformer"].parameters()} == {torch.float32}  # as saved
    with pytest.raises(ValueError, match="T2I_EXECUTOR_DTYPES"):
        parse_dtypes("tiny-flux=int3")
