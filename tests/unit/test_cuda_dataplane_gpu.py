"""The data plane on a real GPU (marked ``gpu`` / ``nvshmem``; skipped, with the reason, elsewhere):

* a CUDA executor's outputs stay in its device arena and a consumer on the same executor views them;
* a CUDA IPC pull between two processes (CUDA refuses to open a handle in the process that made it)
  lands the producer's bytes with one device-to-device copy, and a released block is refused;
* a two-PE NVSHMEM world on one GPU (NVSHMEM's several-processes-per-GPU mode, put/get only)
  pulls one PE's tensor into the other's arena.

The bandwidth of the IPC pull against a plain device-to-device copy is measured by
bench/gpu/ipc_pull.py (bench/gpu/run.sh), not asserted here: tests assert behaviour, not timings.
Each multi-process case runs in fresh interpreters (CUDA and NVSHMEM initialise once per process).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _run(code: str, *args: str, timeout: float = 180) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


@pytest.mark.gpu
def test_outputs_stay_in_the_device_arena_and_a_local_consumer_views_them() -> None:
    import uuid

    from libs.dataplane.store import TensorStore
    from libs.dataplane.transport import make_transport

    t = make_transport("cuda_ipc", namespace="g" + uuid.uuid4().hex[:8], executor_id="a", capacity=64 * MIB)
    try:
        store = TensorStore("a", t)
        x = torch.randn(256, 1024, device="cuda")
        meta = store.put("x", x, consumers=1, group="g")
        assert meta.device.startswith("cuda") and meta.transport == "cuda_ipc"
        lease = store.open(meta)
        assert lease.local and lease.copies == 0 and lease.tensor.is_cuda
        assert lease.tensor.data_ptr() == t.arena.memory.data_ptr() + meta.offset
        assert torch.equal(lease.tensor, x)
    finally:
        t.close()


_PRODUCER = """
import sys, torch
from libs.dataplane.store import TensorStore
from libs.dataplane.transport import make_transport
from libs.protocol.tensor_meta import encode_meta
ns, n = sys.argv[1], int(sys.argv[2])
t = make_transport("cuda_ipc", namespace=ns, executor_id="prod", capacity=1 << 30)
store = TensorStore("prod", t)
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda", generator=g)
meta = store.put("x", x, consumers=1, group="g")
print("META", encode_meta(meta).hex(), int(x.sum(dtype=torch.int64)), flush=True)
assert sys.stdin.readline().strip() == "release"
store.release("x")
print("RELEASED", flush=True)
sys.stdin.readline()
t.close()
"""

_CONSUMER = """
import sys, torch
from libs.dataplane.errors import StaleTensorError
from libs.dataplane.store import TensorStore
from libs.dataplane.transport import make_transport
from libs.protocol.tensor_meta import decode_meta
ns, raw = sys.argv[1], bytes.fromhex(sys.argv[2])
t = make_transport("cuda_ipc", namespace=ns, executor_id="cons", capacity=1 << 30)
store = TensorStore("cons", t)
meta = decode_meta(raw)
with store.open(meta) as lease:
    assert lease.tensor.is_cuda and lease.copies == 1 and not lease.local
    print("SUM", int(lease.tensor.sum(dtype=torch.int64)), flush=True)
assert sys.stdin.readline().strip() == "again"
try:
    store.open(meta)
except StaleTensorError:
    print("STALE", flush=True)
t.close()
"""


@pytest.mark.gpu
def test_a_cuda_ipc_pull_between_two_processes_lands_the_bytes_and_a_released_block_is_refused() -> None:
    import uuid

    ns = "g" + uuid.uuid4().hex[:8]
    prod = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_PRODUCER), ns, str(16 * MIB)], cwd=REPO, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        line = prod.stdout.readline().split()
        assert line[0] == "META", line
        cons = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_CONSUMER), ns, line[1]], cwd=REPO, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        got = cons.stdout.readline().split()
        assert got == ["SUM", line[2]]
        prod.stdin.write("release\n")
        prod.stdin.flush()
        assert prod.stdout.readline().strip() == "RELEASED"
        cons.stdin.write("again\n")
        cons.stdin.flush()
        assert cons.stdout.readline().strip() == "STALE"
        assert cons.wait(60) == 0
    finally:
        if prod.poll() is None:
            prod.stdin.write("exit\n")
            prod.stdin.flush()
            prod.wait(60)


_PE = """
import sys, time, pathlib, torch
from libs.dataplane.store import TensorStore
from libs.dataplane.transport.nvshmem import NvshmemTransport
from libs.protocol.tensor_meta import encode_meta, decode_meta
rank, box = int(sys.argv[1]), pathlib.Path(sys.argv[2])
def exchange(uid):
    if uid is not None:
        (box / "uid.tmp").write_bytes(uid); (box / "uid.tmp").rename(box / "uid"); return uid
    while not (box / "uid").exists(): time.sleep(0.05)
    return (box / "uid").read_bytes()
t = NvshmemTransport(rank=rank, nranks=2, capacity=64 << 20, exchange_uid=exchange, device_index=0)
store = TensorStore(f"pe{rank}", t)
if rank == 0:
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    (box / "meta").write_bytes(encode_meta(store.put("x", x, consumers=1, group="g")))
    while not (box / "done").exists(): time.sleep(0.05)
else:
    while not (box / "meta").exists(): time.sleep(0.05)
    time.sleep(0.2)
    with store.open(decode_meta((box / "meta").read_bytes())) as lease:
        assert lease.copies == 1 and lease.tensor.is_cuda
        assert torch.equal(lease.tensor, torch.arange(1 << 20, dtype=torch.float32, device="cuda"))
    (box / "done").write_text("ok")
print("PE", rank, "ok", flush=True)
t.finalize()
"""


@pytest.mark.nvshmem
@pytest.mark.skipif(
    importlib.util.find_spec("nvshmem") is None, reason="nvshmem4py is not installed (the 'gpu' extra)"
)
def test_a_two_pe_nvshmem_world_on_one_gpu_pulls_one_pes_tensor_into_the_other(tmp_path: Path) -> None:
    procs = [_run(_PE, str(r), str(tmp_path)) for r in (0, 1)]
    outs = [_finish(p) for p in procs]
    assert "PE 0 ok" in outs[0] and "PE 1 ok" in outs[1]


@pytest.mark.gpu
def test_on_cuda_cached_weights_use_the_device_arena_and_communication_takes_them_back(
    tmp_path: Path,
) -> None:
    """A weight budget below the transformer puts its last layers in the device arena (same device,
    never host memory bound into a CUDA module); an output that needs the space reclaims them."""
    import uuid

    from libs.dataplane.loader import Loader
    from libs.dataplane.store import TensorStore
    from libs.dataplane.transport import make_transport
    from libs.models import tiny_flux
    from libs.protocol.ids import ModelKey
    from services.executor.runtime import ModelCache

    tiny_flux.build(tmp_path)
    key = ModelKey("flux.transformer", "tiny-flux")
    t = make_transport("cuda_ipc", namespace="g" + uuid.uuid4().hex[:8], executor_id="w", capacity=4 * MIB)
    try:
        with Loader() as loader:
            probe = ModelCache(tmp_path, "cuda", loader)
            probe.components(key.fn, key.model)
            nbytes = probe.weights.models[key].nbytes
            del probe
            cache = ModelCache(
                tmp_path, "cuda", loader, budget=nbytes // 2, arena=t.arena, arena_budget=t.arena.capacity
            )
            cache.components(key.fn, key.model)
            slots = cache.weights.models[key].slots
            assert any(s.where == "arena" for s in slots), [s.where for s in slots]
            assert all(s.storage is None or s.storage.is_cuda for s in slots)
            store = TensorStore("w", t, alloc_timeout=0)
            meta = store.put("big", torch.ones(t.arena.capacity // 4, device="cuda"), consumers=1, group="g")
            assert meta.nbytes == t.arena.capacity  # the whole arena: cached weights made way
            assert cache.weights.evictions > 0 and not any(s.where == "arena" for s in slots)
    finally:
        t.close()
