"""An executor's weights stay within its budget, measured in the process's resident set, while a
workload cycles through all 21 catalog workflows twice, and the images do not change.

On the CPU the weight cache keeps each layer in an anonymous shared mapping, so the kernel counts
exactly those pages under ``RssShmem`` in ``/proc/<pid>/status`` (the process maps no other shared
memory here but a page or so of its runtime's: no host tier, no arena). The workload runs in a fresh process so nothing else
allocated by the test session shows up. The same cycle without a budget holds every workflow's
weights at once, so a cache that ignored its budget would fail the check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUDGET = 2_000_000  # bytes; every catalog workflow's tiny models hold several times as much together

WORKLOAD = """
import gc, json, sys
from pathlib import Path
import numpy as np, torch
from libs.dataplane.loader import Loader
from libs.workflow.local import LocalRunner
from services.executor.runtime import ModelCache
from tests.unit.model_families import HARNESSES, NEGATIVE
from tests.unit.test_img2img_inpaint import CASES as EDIT_CASES, edit_images

torch.set_num_threads(1)
root, budget = Path(sys.argv[1]), int(sys.argv[2])

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out

harnesses = [H(root) for H in HARNESSES.values()]
edits = {}  # the img2img and inpainting workflows: their first case in test_img2img_inpaint.py
for case in EDIT_CASES:
    edits.setdefault(case.values[0], case.values[1])
jobs = []
for h in harnesses:
    for name in sorted(h.specs):
        extra = {"negative_prompt": NEGATIVE, "true_cfg_scale": 2.5} if name.endswith("cfg-parallel") else None
        changes = extra or edits.get(name) or next(c for w, c, _ in h.cases if w == name)
        jobs.append((h, name, h.request(name, **changes)))

def cycle(cache, cycles, images):
    runners = {h.family: LocalRunner(h.root, classes=h.classes(), models=cache) for h in harnesses}
    samples = []
    for _ in range(cycles):
        for h, name, params in jobs:
            pictures = {**h.images(name, params), **(edit_images(params) if name in edits else {})}
            out = runners[h.family].run(h.specs[name], params, images=pictures, loras=h.loras)
            image = out["image"].numpy()
            if name in images and not np.array_equal(images[name], image):
                raise SystemExit(f"{name}: the image changed")
            images[name] = image
            samples.append({"workflow": name, "cache": cache.weights.resident_bytes(), **status()})
    return samples

images = {}
with Loader() as loader:
    gc.collect()
    before = status()
    bounded = ModelCache(root, "cpu", loader, budget=budget)
    samples = cycle(bounded, 2, images)
    evictions = bounded.weights.evictions
    del bounded
    gc.collect()
    unbounded = cycle(ModelCache(root, "cpu", loader), 1, images)
print(json.dumps({"before": before, "bounded": samples, "evictions": evictions, "unbounded": unbounded, "jobs": len(jobs)}))
"""


@pytest.mark.usefixtures("one_torch_thread")
def test_the_weights_resident_set_stays_under_the_budget_while_cycling_through_every_workflow(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WORKLOAD, str(tmp_path / "models"), str(BUDGET)],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    bounded, unbounded = report["bounded"], report["unbounded"]

    assert report["jobs"] >= 45 and len(bounded) == 2 * report["jobs"] and report["evictions"] > 0
    base = report["before"]["RssShmem"]  # a page or so the runtime maps before any model
    assert base < BUDGET // 10
    for sample in bounded:  # after every request: the kernel's count and the cache's books
        assert sample["RssShmem"] - base <= BUDGET, sample
        assert sample["cache"] <= BUDGET, sample
    # Without a budget the same workload holds several times as much: the check can fail.
    assert max(s["RssShmem"] for s in unbounded) - base > 4 * BUDGET
