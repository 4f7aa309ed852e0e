"""The NVSHMEM transport on a real GPU: a one-PE world, driven through the real TensorStore.

A world of one PE still runs the whole path a pull between executors takes: UID bootstrap,
collective symmetric allocation, ``getmem_on_stream`` from PE 0 (ourselves) into a second block,
and the integrity tag fetched over NVSHMEM and checked. Two PEs need two GPUs (NVSHMEM places one
PE per device), which the lent machine does not have.

Each case runs in a fresh interpreter: NVSHMEM is initialised once per process and its world is
fixed at init, so a test must not leave it behind for the next one.

Skipped, with the reason shown, where nvshmem4py or a CUDA device is missing (marker ``nvshmem``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.nvshmem

REPO = Path(__file__).resolve().parents[2]

if importlib.util.find_spec("nvshmem") is None:
    pytestmark = [pytestmark, pytest.mark.skip(reason="nvshmem4py is not installed (the 'gpu' extra)")]

_SCRIPT = textwrap.dedent(
    """
    import msgspec, torch
    from libs.dataplane.errors import StaleTensorError, TransportError
    from libs.dataplane.store import TensorStore
    from libs.dataplane.transport.nvshmem import NvshmemTransport

    uid_box = []
    def exchange(uid):
        if uid is not None:
            uid_box.append(uid)
            return uid
        return uid_box[0]

    t = NvshmemTransport(rank=0, nranks=1, capacity=64 << 20, exchange_uid=exchange)
    store = TensorStore("pe0", t)
    src = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    meta = store.put("a", src, consumers=1, group="r1")
    assert meta.transport == "nvshmem" and meta.address == "0" and meta.generation > 0, meta

    # Device pull: getmem from PE 0 into a fresh block of our arena, tag checked over NVSHMEM.
    dst = t.arena.allocate(meta.nbytes)
    t.read_into(meta, dst)
    got = t.arena.tensor(dst, meta.nbytes).view(torch.bfloat16).view(1024, 1024)
    assert torch.equal(got, src), "device pull differs"
    t.arena.free(dst)

    # Host pull through a staging block.
    host = bytearray(meta.nbytes)
    t.read(meta, memoryview(host))
    back = torch.frombuffer(host, dtype=torch.bfloat16).view(1024, 1024)
    assert torch.equal(back, src.cpu()), "host pull differs"

    # A reader holding an old incarnation of the block is refused once the tensor is gone.
    assert store.release("a")
    try:
        t.read_into(meta, t.arena.allocate(meta.nbytes))
    except StaleTensorError:
        pass
    else:
        raise AssertionError("a pull of a freed tensor was not refused")

    # Out-of-range and wrong-kind metadata are refused with our error type.
    bad = msgspec.structs.replace(meta, offset=t.arena.capacity)
    for m in (bad, msgspec.structs.replace(meta, transport="shm"), msgspec.structs.replace(meta, address="3")):
        try:
            t.read_into(m, 0)
        except TransportError:
            continue
        raise AssertionError(f"{m} was not refused")
    t.finalize()
    print("NVSHMEM-OK", meta.nbytes)
    """
)


def test_one_pe_world_pulls_through_the_tensor_store() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none on this machine)")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0 and "NVSHMEM-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
