"""An executor of an NVSHMEM world falls back to CUDA IPC without losing a tensor
(libs/dataplane/transport/fallback.py): after the switch its new outputs go to the CUDA IPC arena,
those already in the world's arena stay readable there and are freed there, and a peer that has or
has not switched yet reads either kind into whichever arena it uses. NVSHMEM needs GPUs: a CUDA IPC
transport over host memory, with the world's transport kind, stands in for it behind the same
interface (``read_into`` / ``read_to`` into a device arena)."""

from __future__ import annotations

import uuid

import msgspec
import pytest
import torch

from libs.dataplane.store import TensorStore
from libs.dataplane.transport.fallback import FallbackTransport
from libs.dataplane.transport.ipc import CudaIpcTransport, HostBackend
from libs.protocol.errors import BadTensorMetaError

CAP = 1 << 20


class StandInWorld(CudaIpcTransport):
    kind = "nvshmem"


@pytest.fixture
def pair():
    ns = "fb" + uuid.uuid4().hex[:8]
    made = []
    for name in ("a", "b"):
        world = StandInWorld(ns, f"{name}-world", CAP, backend=HostBackend())
        ipc = CudaIpcTransport(ns, name, CAP, backend=HostBackend())
        made.append(FallbackTransport(world, ipc))
    yield made
    for t in made:
        t.close()


def test_falling_back_moves_new_tensors_to_cuda_ipc_and_keeps_the_worlds_readable(pair):
    a, b = pair
    sa, sb = TensorStore("a", a), TensorStore("b", b)
    x = torch.arange(1000, dtype=torch.float32)
    in_world = sa.put("x", x, consumers=3, group="g")
    assert in_world.transport == "nvshmem" and a.kind == "nvshmem"
    with sb.open(in_world) as lease:
        assert torch.equal(lease.tensor, x) and lease.copies == 1

    assert a.fall_back() and not a.fall_back()  # once
    assert a.kind == "cuda_ipc" and a.address == a.fallback.address
    after = sa.put("y", x * 2, consumers=2, group="g")
    assert after.transport == "cuda_ipc"
    # B still uses the world's arena: A's new tensor lands there, read over CUDA IPC.
    with sb.open(after) as lease:
        assert torch.equal(lease.tensor, x * 2)
    assert b.primary.arena.stats()["used"] == 0 == b.fallback.arena.stats()["used"]  # copies freed

    b.fall_back()
    with sb.open(in_world) as lease:  # a world tensor into B's CUDA IPC arena
        assert torch.equal(lease.tensor, x)
        base = b.fallback.arena.memory.data_ptr()
        assert base <= lease.tensor.data_ptr() < base + CAP
    # A's own consumers still view each tensor where it was written.
    local = sa.open(in_world)
    assert local.local and local.tensor.data_ptr() == a.primary.arena.memory.data_ptr() + in_world.offset
    local.close()

    # Each block is freed in the arena that holds it.
    assert a.primary.arena.stats()["used"] > 0 and a.fallback.arena.stats()["used"] > 0
    sa.release("x", 3)
    sa.release("y", 2)
    assert a.primary.arena.stats()["used"] == 0 == a.fallback.arena.stats()["used"]


def test_a_tensor_of_a_third_kind_is_refused_with_a_reason(pair):
    a, b = pair
    meta = TensorStore("a", a).put("x", torch.ones(16), consumers=1, group="g")
    with pytest.raises(BadTensorMetaError, match="'nvshmem' or 'cuda_ipc'"):
        TensorStore("b", b).open(msgspec.structs.replace(meta, transport="tcp"))
    with pytest.raises(ValueError, match="must differ"):
        FallbackTransport(b.fallback, b.fallback)
