"""The compose init job (``python -m libs.launcher.register``) against a running registry."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from libs.launcher.register import main as register_main
from libs.models import families
from tests.conftest import REPO
from tests.support.registry import running_registry


@pytest.fixture
async def registry(common):
    async with running_registry(common) as r:
        yield r.client


def run_init(common, tmp_path, *args: str, workflows: str = "") -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "T2I_NATS_URL": common.nats_url,
        "T2I_NAMESPACE": common.namespace,
        "T2I_WORKFLOWS": workflows,
    }
    return subprocess.run(
        [sys.executable, "-m", "libs.launcher.register", "--wait-s", "20", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )


async def test_the_init_job_registers_the_catalog_and_named_models_idempotently(registry, common, tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    from libs.models.flux_workflows import flux_workflow
    from libs.workflow.spec import encode_spec

    own = flux_workflow("my-flux", "/local-models/my-flux", sizes=["512x512"], steps=8)
    (specs / "my-flux.json").write_bytes(encode_spec(own))
    hub = "flux-schnell=flux:black-forest-labs/FLUX.1-schnell?size=1024x1024&steps=4&guidance=0"
    done = await _in_thread(run_init, common, tmp_path, "--specs", str(specs), workflows=hub)
    assert done.returncode == 0, done.stderr
    listed = {w.name: w for w in (await registry.list()).workflows}
    assert {s.name for s in families.workflows()} <= set(listed)
    assert {"flux-schnell", "my-flux"} <= set(listed) and listed["flux-schnell"].sizes == ["1024x1024"]
    stored = await registry.get("flux-schnell")
    assert {op.model for op in stored.body if getattr(op, "model", "")} == {
        "black-forest-labs/FLUX.1-schnell"
    }
    assert set(families.LORAS) <= {lora.name for lora in await registry.list_loras()}
    # Again (the next `up`): nothing new, the same versions.
    again = await _in_thread(run_init, common, tmp_path, "--specs", str(specs), workflows=hub)
    assert again.returncode == 0 and "(0 new or changed)" in again.stdout, again.stdout + again.stderr
    assert all(w.version == 1 for w in (await registry.list()).workflows)


async def test_a_bad_entry_or_a_refused_spec_fails_the_init_job_with_the_reason(registry, common, tmp_path):
    assert register_main(["--no-catalog", "--workflow", "Bad=flux:x"]) == 2
    specs = tmp_path / "specs"
    specs.mkdir()
    from libs.models.flux_workflows import tiny_flux
    from libs.workflow.spec import encode_spec

    broken = tiny_flux()
    broken.body[0].fn = "nope.fn"
    (specs / "broken.json").write_bytes(encode_spec(broken))
    done = await _in_thread(run_init, common, tmp_path, "--no-catalog", "--specs", str(specs))
    assert done.returncode == 1 and "broken.json" in done.stderr and "nope.fn" in done.stderr, done.stderr


async def _in_thread(fn, *args, **kw):
    """The job is another process; the registry it talks to runs on this test's loop."""
    return await asyncio.to_thread(fn, *args, **kw)
