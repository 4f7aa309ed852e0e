"""The GPU lease's view of a real GPU box: the GPUs it would claim are the ones CUDA sees, and the
``CUDA_VISIBLE_DEVICES`` it sets before torch starts leaves exactly the claimed GPU visible.

The claiming itself (Redis SET NX, expiry, release) is tested without a GPU in
``tests/integration/test_gpu_lease.py``; these need a CUDA device (marker ``gpu``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu


def _python(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_lease_lists_the_gpus_cuda_sees_and_pins_the_claimed_one() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none on this machine)")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # as compose sets it: lease index = nvidia-smi index
    listed = _python(
        "from libs.common.gpu_lease import visible_gpus; import torch; "
        "print(len(visible_gpus()), torch.cuda.device_count())",
        env,
    ).split()
    assert listed[0] == listed[1] != "0", listed  # nvidia-smi's list, as the container sees it
    last = str(int(listed[0]) - 1)
    # GpuLease.apply, as the executor calls it once it holds `last` (the claim in Redis is the
    # integration test's; a client that never connects stands in for it here).
    seen = _python(
        "from redis.asyncio import Redis; from libs.common.gpu_lease import GpuLease, visible_gpus; "
        "lease = GpuLease(Redis(), 'gpu-test', visible_gpus()); "
        f"lease.gpu, lease.index = {last!r}, {int(last)}; device = lease.apply('cuda'); import torch; "
        "torch.zeros(1, device=device); print(device, torch.cuda.device_count())",
        env,
    )
    assert seen.split() == ["cuda", "1"], seen
