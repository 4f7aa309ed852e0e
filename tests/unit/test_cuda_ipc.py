"""The CUDA IPC transport's protocol on the CPU (libs/dataplane/transport/ipc.py): a device arena whose
outputs a consumer on the same executor views without a copy, an export read once by peers (the
record in the executor's segment), one copy per pull from a peer on the box, and the shared-memory
transport's identity checks, so a stale, reused or restarted producer's block is refused. The
device memory here is the host backend's (a second shared-memory segment): the CUDA backend runs
the same code with cudaMalloc / cudaIpcOpenMemHandle and is tested on a GPU
(tests/unit/test_cuda_dataplane_gpu.py)."""

from __future__ import annotations

import multiprocessing as mp
import uuid

import msgspec
import pytest
import torch

from libs.dataplane.arena import segment_exists
from libs.dataplane.errors import DataPlaneError, StaleTensorError, TransportError
from libs.dataplane.store import TensorStore
from libs.dataplane.transport import make_transport
from libs.dataplane.transport.ipc import CudaIpcTransport, HostBackend
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import decode_meta, encode_meta

CAP = 1 << 20


@pytest.fixture
def ns():
    return "ipc" + uuid.uuid4().hex[:8]


@pytest.fixture
def pair(ns):
    a = CudaIpcTransport(ns, "a", CAP, backend=HostBackend())
    b = CudaIpcTransport(ns, "b", CAP, backend=HostBackend())
    yield a, b
    b.close()
    a.close()


def test_a_consumer_on_the_same_executor_views_the_output_where_it_was_written(pair):
    a, _ = pair
    store = TensorStore("a", a)
    x = torch.randn(32, 48)
    meta = store.put("x", x, consumers=1, group="g")
    assert meta.transport == "cuda_ipc" and meta.address == a.address and meta.device == a.arena.device
    lease = store.open(meta)
    assert lease.local and lease.copies == 0
    assert torch.equal(lease.tensor, x)
    # The very bytes in the device arena, not a copy of them.
    assert lease.tensor.data_ptr() == a.arena.memory.data_ptr() + meta.offset
    a.arena.memory[meta.offset : meta.offset + 4] = 0
    assert lease.tensor.flatten()[0].item() == 0.0


def test_a_peer_pulls_with_one_copy_and_a_released_or_reused_block_is_refused(pair):
    a, b = pair
    sa, sb = TensorStore("a", a), TensorStore("b", b)
    x = torch.arange(4096, dtype=torch.float32).view(64, 64)
    meta = sa.put("x", x, consumers=1, group="g")
    with sb.open(meta) as lease:
        assert not lease.local and lease.copies == 1 == b.copies_per_pull
        assert torch.equal(lease.tensor, x)
        assert b.arena.memory.data_ptr() <= lease.tensor.data_ptr() < b.arena.memory.data_ptr() + CAP
    assert b.peers == [a.address]  # the export was read once and is kept
    host = bytearray(meta.nbytes)  # a pull into host memory, staged through our device arena
    b.read(meta, memoryview(host))
    assert torch.equal(torch.frombuffer(host, dtype=torch.float32).view(64, 64), x)
    assert b.arena.stats()["used"] == 0

    sa.release("x")
    with pytest.raises(StaleTensorError, match="released"):
        sb.open(meta)
    again = sa.put("y", x + 1, consumers=1, group="g")
    assert again.offset == meta.offset  # the same block, now another tensor's
    with pytest.raises(StaleTensorError):
        sb.open(meta)
    with sb.open(again) as lease:
        assert torch.equal(lease.tensor, x + 1)
    # The metadata travels over the bus as bytes and comes back the same.
    assert decode_meta(encode_meta(again)) == again


def test_a_restarted_producer_is_mapped_again_and_its_predecessors_tensors_are_refused(ns):
    a = CudaIpcTransport(ns, "a", CAP, backend=HostBackend())
    b = CudaIpcTransport(ns, "b", CAP, backend=HostBackend())
    try:
        sa, sb = TensorStore("a", a), TensorStore("b", b)
        old = sa.put("x", torch.ones(1000), consumers=2, group="g")
        sb.open(old).close()
        a.close()  # the producer dies; a successor takes its name
        with pytest.raises(TransportError):
            sb.open(old)
        a = CudaIpcTransport(ns, "a", CAP, backend=HostBackend())
        sa = TensorStore("a", a)
        new = sa.put("x", torch.full((1000,), 7.0), consumers=1, group="g")
        assert (new.address, new.offset) == (old.address, old.offset)
        with pytest.raises(StaleTensorError):
            sb.open(old)  # same name, same offset: another incarnation's tag
        with sb.open(new) as lease:
            assert torch.equal(lease.tensor, torch.full((1000,), 7.0))
    finally:
        b.close()
        a.close()
    assert not segment_exists(f"t2i-{ns}-a") and not segment_exists(f"t2i-{ns}-a-dev")


def test_bad_or_foreign_exports_are_refused_with_a_reason(ns, pair):
    a, b = pair
    meta = TensorStore("a", a).put("x", torch.ones(256), consumers=1, group="g")
    sb = TensorStore("b", b)
    with pytest.raises(TransportError, match="outside the peer arena"):
        sb.open(msgspec.structs.replace(meta, offset=CAP))
    with pytest.raises(TransportError, match="does not exist"):
        sb.open(msgspec.structs.replace(meta, address=f"t2i-{ns}-nobody"))
    with pytest.raises(BadTensorMetaError, match="transport"):
        b.read_into(msgspec.structs.replace(meta, transport="shm"), 0)

    class Other(HostBackend):
        name = "other"

    c = CudaIpcTransport(ns, "c", CAP, backend=Other())
    try:
        foreign = TensorStore("c", c).put("x", torch.ones(256), consumers=1, group="g")
        with pytest.raises(TransportError, match="exports 'other' memory"):
            sb.open(foreign)
    finally:
        c.close()
    # A shared-memory producer's segment holds no export record.
    shm = make_transport("shm", namespace=ns, executor_id="s", capacity=CAP)
    try:
        plain = TensorStore("s", shm).put("x", torch.ones(256), consumers=1, group="g")
        with pytest.raises(TransportError, match="no device-arena record"):
            sb.open(msgspec.structs.replace(plain, transport="cuda_ipc"))
    finally:
        shm.close()


def test_without_a_gpu_the_cuda_backend_says_why():
    with pytest.raises(DataPlaneError, match="CUDA IPC transport unavailable"):
        make_transport("cuda_ipc", namespace="x", executor_id="y", capacity=CAP, device="cuda")


def _consume(ns: str, raw: bytes, out: mp.Queue) -> None:
    b = CudaIpcTransport(ns, "b", CAP, backend=HostBackend())
    try:
        with TensorStore("b", b).open(decode_meta(raw)) as lease:
            out.put((lease.copies, lease.tensor.sum().item(), list(lease.tensor.shape)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(repr(e))
    finally:
        b.close()


def test_a_peer_in_another_process_pulls_through_the_export(ns):
    a = CudaIpcTransport(ns, "a", CAP, backend=HostBackend())
    try:
        x = torch.arange(10000, dtype=torch.float64)
        meta = TensorStore("a", a).put("x", x, consumers=1, group="g")
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_consume, args=(ns, encode_meta(meta), out))
        p.start()
        got = out.get(timeout=120)
        p.join(30)
        assert got == (1, x.sum().item(), [10000])
    finally:
        a.close()


def test_auto_picks_the_device_arena_on_cuda_and_shared_memory_on_the_cpu():
    from services.executor.__main__ import transport_kind
    from services.executor.config import ExecutorConfig

    assert transport_kind(ExecutorConfig(device="cuda")) == "cuda_ipc"
    assert transport_kind(ExecutorConfig(device="cuda:1")) == "cuda_ipc"
    assert transport_kind(ExecutorConfig(device="cpu")) == "shm"
    assert transport_kind(ExecutorConfig(device="cpu", transport="tcp")) == "tcp"
    with pytest.raises(SystemExit, match="needs a cuda device"):
        transport_kind(ExecutorConfig(device="cpu", transport="cuda_ipc"))
    with pytest.raises(SystemExit, match="must be one of"):
        transport_kind(ExecutorConfig(transport="rdma"))


def test_cached_weights_live_in_the_device_arena_and_an_output_takes_them_back(ns, tmp_path):
    """The weights' elastic share (paper §5.3) in the device arena: a budget below the transformer
    puts its last layers in arena blocks (tensor views of the arena, on its device), and an output
    that needs the space reclaims them at once."""
    from libs.dataplane.loader import Loader
    from libs.models import tiny_flux
    from libs.protocol.ids import ModelKey
    from services.executor.runtime import ModelCache

    tiny_flux.build(tmp_path)
    key = ModelKey("flux.transformer", "tiny-flux")
    t = CudaIpcTransport(ns, "w", CAP, backend=HostBackend())
    try:
        with Loader() as loader:
            probe = ModelCache(tmp_path, "cpu", loader)
            probe.components(key.fn, key.model)
            nbytes = probe.weights.models[key].nbytes
            expected = probe.fn(key.fn)
            cache = ModelCache(tmp_path, "cpu", loader, budget=nbytes // 2, arena=t.arena, arena_budget=CAP)
            comps, _ = cache.components(key.fn, key.model)
            slots = cache.weights.models[key].slots
            in_arena = [s for s in slots if s.where == "arena"]
            assert in_arena and all(
                t.arena.memory.data_ptr() <= s.storage.data_ptr() < t.arena.memory.data_ptr() + CAP
                for s in in_arena
            )
            same = all(
                torch.equal(p, q)
                for p, q in zip(comps["transformer"].state_dict().values(),
                                probe.components(key.fn, key.model)[0]["transformer"].state_dict().values(), strict=True)
            )  # fmt: skip
            assert same and expected is not None
            meta = TensorStore("w", t, alloc_timeout=0).put(
                "big", torch.ones(CAP // 4), consumers=1, group="g"
            )
            assert meta.nbytes == CAP and cache.weights.evictions >= len(in_arena)  # the whole arena
            assert not any(s.where == "arena" for s in slots)
    finally:
        t.close()


def test_a_cuda_ipc_handle_keeps_all_its_bytes_through_the_record():
    """cudaIpcMemHandle_t holds NUL bytes: read as a ctypes char array it would be cut at the first
    one, and the peer would open garbage (found by reading the code: no GPU here)."""
    from libs.dataplane.transport.ipc import handle_bytes, handle_of

    raw = bytes([7, 0, 0, 3]) + bytes(58) + bytes([0, 9])
    assert handle_bytes(handle_of(raw)) == raw and len(raw) == 64
    with pytest.raises(ValueError, match="64 bytes"):
        handle_of(raw[:63])
