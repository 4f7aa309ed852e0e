"""Deployment files and the torch-free control plane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_compose_file_validates_and_runs_each_service_in_its_own_scalable_container():
    compose = os.path.join(sysconfig.get_path("scripts"), "docker-compose")
    done = subprocess.run(
        [compose, "-f", str(REPO / "deploy" / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "T2I_API_KEYS": "sk-x=x:admin"},
    )
    assert done.returncode == 0, done.stderr
    cfg = json.loads(done.stdout)
    services = cfg["services"]
    assert {"nats", "redis", "gateway", "registry", "scheduler", "executor"} <= set(services)
    assert "-js" in services["nats"]["command"]
    executor = services["executor"]
    (device,) = executor["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["count"] == 1
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
