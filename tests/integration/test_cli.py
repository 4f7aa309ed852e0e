"""The ``t2i`` command line against a running platform, run as the installed executable.

One stack per module (registry, scheduler, gateway and two simulated executors as processes, over
the real NATS and Redis, in a namespace of its own) with ``cli-wf``: a 4-step workflow whose
models take milliseconds, and ``slow-cli-wf``: 8 steps of 0.5 s, for cancelling. Each test runs
``.venv/bin/t2i`` in a subprocess with ``T2I_URL``/``T2I_API_KEY`` in its environment, as a user would.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from libs.launcher.stack import Stack
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.support.stacks import sim_stack, started
from tests.support.toyprofile import write_family_profile
from tests.support.waiting import until_sync

KEYS = "sk-cli-alice=alice,sk-cli-ops=ops:admin"
TENANT, ADMIN = "sk-cli-alice", "sk-cli-ops"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def t2i_executable() -> str:
    """The console script pip installed next to this interpreter (``make install`` puts it there)."""
    here = Path(sys.executable).parent / "t2i"
    found = str(here) if here.exists() else shutil.which("t2i")
    assert found, "the t2i console script is not installed: run `pip install -e .`"
    return found


def write_profile(path: Path) -> None:
    write_family_profile(path, {"fast": 0.01, "slow": 0.5})


@pytest.fixture(scope="module")
def stack(broker_urls, tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("cli-stack")
    write_profile(tmp / "profile.json")
    nats_url, redis_url = broker_urls
    s = sim_stack(
        tmp, api_keys=KEYS, sim_profile=str(tmp / "profile.json"), nats_url=nats_url, redis_url=redis_url
    )
    with started(s):
        for name, fam, steps in (("cli-wf", "fast", 4), ("slow-cli-wf", "slow", 8), ("cli-edit", "fast", 2)):
            spec = json.loads(encode_spec(sim_workflow(name, fam, steps=steps)))
            if name == "cli-edit":  # an editor, for the gateway: an uploaded image fills ``image``
                spec["params"]["image"] = {"type": "image", "required": True}
                spec["params"]["mask"] = {"type": "image"}
                spec["params"]["strength"] = {"type": "float", "default": 0.8, "minimum": 0, "maximum": 1}
            status, body = s.http("POST", "/v1/workflows", spec, key=ADMIN)
            assert status == 201, body
        yield s


def t2i(
    stack: Stack, *args: str, key: str | None = TENANT, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("T2I_")}
    env["T2I_URL"] = stack.url
    env["COLUMNS"] = "200"  # tables unwrapped, whatever the terminal running the tests
    if key is not None:
        env["T2I_API_KEY"] = key
    return subprocess.run(
        [t2i_executable(), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def explain(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"


# -- generate ---------------------------------------------------------------------------------------
def test_generate_saves_a_png_and_shows_progress_over_the_steps(stack, tmp_path):
    out = tmp_path / "fox.png"
    p = t2i(stack, "generate", "-m", "cli-wf", "a red fox", "--steps", "4", "--seed", "3", "--out", str(out))
    assert p.returncode == 0, explain(p)
    with Image.open(io.BytesIO(out.read_bytes())) as img:
        assert img.format == "PNG"
        img.verify()
    assert out.read_bytes().startswith(PNG_MAGIC)
    # Progress over denoising steps, one line per step off a terminal, in order, ending at 4/4.
    steps = [int(m) for m in re.findall(r"step (\d+)/4", p.stderr)]
    assert steps and steps == sorted(steps) and steps[-1] == 4, explain(p)
    assert f"saved {out}" in p.stdout, explain(p)
    gpu = re.search(r"gpu_seconds: ([0-9.]+)", p.stdout)
    assert gpu and float(gpu.group(1)) > 0, explain(p)
    assert "Traceback" not in p.stderr


def test_edit_uploads_the_image_and_mask_and_saves_the_result(stack, tmp_path):
    picture, mask = tmp_path / "in.png", tmp_path / "mask.png"
    Image.new("RGB", (32, 32), "red").save(picture)
    Image.new("RGBA", (32, 32), (0, 0, 0, 0)).save(mask)
    out = tmp_path / "edited.png"
    p = t2i(
        stack, "edit", "a hat", "-m", "cli-edit", "--image", str(picture), "--mask", str(mask),
        "--strength", "0.5", "--seed", "2", "--out", str(out),
    )  # fmt: skip
    assert p.returncode == 0, explain(p)
    assert out.read_bytes().startswith(PNG_MAGIC) and f"saved {out}" in p.stdout, explain(p)
    wrong = t2i(stack, "edit", "a hat", "-m", "cli-wf", "--image", str(picture), "-o", str(tmp_path))
    assert wrong.returncode != 0 and "takes no image" in wrong.stderr and "Traceback" not in wrong.stderr
    missing = t2i(stack, "edit", "a hat", "-m", "cli-edit", "--image", str(tmp_path / "nope.png"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr, explain(missing)


def test_generate_several_images_numbers_the_files(stack, tmp_path):
    p = t2i(stack, "generate", "-m", "cli-wf", "two foxes", "-n", "2", "--steps", "2", "-o", str(tmp_path))
    assert p.returncode == 0, explain(p)
    saved = re.findall(r"^saved (.+)$", p.stdout, re.M)
    assert len(saved) == 2 and all(Path(s).parent == tmp_path for s in saved), explain(p)
    for s in saved:
        assert Path(s).read_bytes().startswith(PNG_MAGIC)
    assert "image 2/2: step" in p.stderr, explain(p)
    # The JSON summary names the same call in the recent calls.
    call_id = Path(saved[0]).stem.removeprefix("t2i-").rsplit("-", 1)[0]
    listed = t2i(stack, "requests", "--json")
    assert listed.returncode == 0, explain(listed)
    calls = {c["id"]: c for c in json.loads(listed.stdout)}
    assert calls[call_id]["status"] == "succeeded" and calls[call_id]["n"] == 2


def test_an_unknown_workflow_is_a_clear_error(stack, tmp_path):
    p = t2i(stack, "generate", "-m", "no-such-wf", "a fox", "--out", str(tmp_path / "x.png"))
    assert p.returncode == 1, explain(p)
    assert "error:" in p.stderr and "no-such-wf" in p.stderr and "HTTP 404" in p.stderr, explain(p)
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "x.png").exists()


def test_bad_arguments_are_refused_before_anything_is_sent(stack, tmp_path):
    for args, what in (
        (("--size", "huge"), "--size"),
        (("--param", "not-a-pair"), "--param"),
        (("--out", str(tmp_path / "missing" / "x.png")), "--out"),
        (("--steps", "0"), "--steps"),
    ):
        p = t2i(stack, "generate", "-m", "cli-wf", "a fox", *args)
        assert p.returncode == 2, explain(p)
        assert what in p.stderr, explain(p)


def test_a_missing_or_wrong_key_says_how_to_set_one(stack):
    p = t2i(stack, "workflows", key="sk-wrong")
    assert p.returncode == 1 and "T2I_API_KEY" in p.stderr and "HTTP 401" in p.stderr, explain(p)


def test_an_unreachable_gateway_is_named(stack):
    env_url = "http://127.0.0.1:9"  # discard port: nothing listens
    p = subprocess.run(
        [t2i_executable(), "workflows", "--url", env_url], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 1 and "cannot reach the gateway" in p.stderr and env_url in p.stderr, explain(p)


# -- catalog ----------------------------------------------------------------------------------------
def test_workflows_lists_the_catalog(stack):
    p = t2i(stack, "workflows")
    assert p.returncode == 0, explain(p)
    assert "cli-wf" in p.stdout and "slow-cli-wf" in p.stdout and "num_inference_steps" in p.stdout
    data = json.loads(t2i(stack, "workflows", "--json").stdout)
    assert {"cli-wf", "slow-cli-wf"} <= {w["name"] for w in data}
    spec = json.loads(t2i(stack, "workflows", "cli-wf").stdout)
    assert spec["name"] == "cli-wf"


def test_register_a_spec_file_then_find_it(stack, tmp_path):
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(encode_spec(sim_workflow("cli-registered-wf", "fast", steps=2)).decode())
    p = t2i(stack, "register", str(spec_file), key=ADMIN)
    assert p.returncode == 0, explain(p)
    assert "registered workflow cli-registered-wf version 1" in p.stdout, explain(p)
    assert "cli-registered-wf" in t2i(stack, "workflows").stdout
    refused = t2i(stack, "register", str(spec_file), key=TENANT)
    assert refused.returncode == 1 and "admin" in refused.stderr, explain(refused)
    spec_file.write_text("{not json")
    bad = t2i(stack, "register", str(spec_file), key=ADMIN)
    assert bad.returncode == 2 and "not JSON" in bad.stderr, explain(bad)


def test_loras_lists_an_empty_catalog(stack):
    p = t2i(stack, "loras", "--json")
    assert p.returncode == 0, explain(p)
    assert json.loads(p.stdout) == []


# -- calls and operators ----------------------------------------------------------------------------
def test_cancel_a_running_call(stack):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", stack.gateway_port, timeout=30)
    body = json.dumps({"model": "slow-cli-wf", "prompt": "slow fox"})
    headers = {
        "Authorization": f"Bearer {TENANT}",
        "Content-Type": "application/json",
        "Prefer": "respond-async",
    }
    conn.request("POST", "/v1/images/generations", body=body, headers=headers)
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    assert resp.status == 202, answer
    p = t2i(stack, "cancel", answer["id"])
    assert p.returncode == 0, explain(p)
    assert answer["id"] in p.stdout and re.search(r": (cancelled|running)", p.stdout), explain(p)
    looked: dict = {}

    def ended() -> bool:  # the call ends: cancelled, not run to the end of its 4 s of denoising
        nonlocal looked
        _, looked = stack.http("GET", f"/v1/requests/{answer['id']}", key=TENANT)
        return looked.get("status") in ("cancelled", "succeeded", "failed")

    assert until_sync(ended, 30, step=0.1), f"the call never ended: {looked}"
    assert looked.get("status") == "cancelled", looked
    unknown = t2i(stack, "cancel", "0" * 20)
    assert unknown.returncode == 1 and "HTTP 404" in unknown.stderr, explain(unknown)


def test_top_shows_tenants_and_executors_to_admins_only(stack, tmp_path):
    first = t2i(stack, "generate", "-m", "cli-wf", "a fox", "-q", "-o", str(tmp_path))
    assert first.returncode == 0, explain(first)
    p = t2i(stack, "top", "--once", key=ADMIN)
    assert p.returncode == 0, explain(p)
    assert "tenants" in p.stdout and "alice" in p.stdout and "executors" in p.stdout, explain(p)
    assert "executors unavailable" not in p.stdout, explain(p)
    refused = t2i(stack, "top", "--once")
    assert refused.returncode == 1 and "admin" in refused.stderr, explain(refused)
