"""The executor's tensor store: put, open (zero-copy or pulled), refcounted release."""

from __future__ import annotations

import gc
import importlib.util
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from libs.dataplane.errors import (
    ArenaFullError,
    DataPlaneError,
    TensorNotFoundError,
    TransportError,
)
from libs.dataplane.store import TensorStore, dtype_name, torch_dtype
from libs.dataplane.transport import ShmTransport, TcpTransport, Transport, make_transport
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import TensorMeta, check_meta, decode_meta, encode_meta

KIB = 1024
BOUND = 30.0


@pytest.fixture
def namespace() -> Iterator[str]:
    """A namespace unique to this test; fails the test if it leaves segments behind (and removes them)."""
    ns = f"test{uuid.uuid4().hex[:8]}"
    yield ns
    leftovers = sorted(p.name for p in Path("/dev/shm").glob(f"t2i-{ns}-*"))
    for name in leftovers:
        os.unlink(f"/dev/shm/{name}")
    assert not leftovers, f"segments left behind: {leftovers}"


def _transport(kind: str, namespace: str, executor: str, capacity: int) -> Transport:
    if kind == "shm":
        return ShmTransport(namespace, executor, capacity)
    return TcpTransport("127.0.0.1", 0, capacity=capacity)


@pytest.fixture
def store(namespace: str) -> Iterator[TensorStore]:
    transport = ShmTransport(namespace, "producer", 64 * KIB)
    try:
        yield TensorStore("producer", transport, alloc_timeout=BOUND)
    finally:
        transport.close()


@pytest.fixture(params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest, namespace: str) -> Iterator[tuple[TensorStore, TensorStore]]:
    """A producer's and a consumer's store, each on its own arena, talking over one transport kind."""
    producer = _transport(request.param, namespace, "producer", 1 << 20)
    consumer = _transport(request.param, namespace, "consumer", 1 << 20)
    try:
        yield (
            TensorStore("producer", producer, alloc_timeout=BOUND),
            TensorStore("consumer", consumer, alloc_timeout=BOUND),
        )
    finally:
        consumer.close()
        producer.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_opening_our_own_tensor_gives_a_zero_copy_view_of_the_arena(store: TensorStore) -> None:
    meta = store.put("r1/a", torch.arange(16, dtype=torch.float32), consumers=2, group="r1")
    first = store.open(meta)
    second = store.open(meta)
    assert first.local and first.transferred_bytes == 0 and first.copies == 0
    first.tensor[0] = 42.0  # tensors are immutable by contract; this only proves aliasing
    assert second.tensor[0].item() == 42.0
    assert store.stats()["copies"] == 0
    first.close()
    assert store.stats()["tensors"] == 1  # closing a local lease frees nothing


def test_the_published_metadata_describes_the_tensor_and_validates(store: TensorStore) -> None:
    meta = store.put("r1/a", torch.zeros(3, 5, dtype=torch.bfloat16), consumers=1, group="r1")
    assert check_meta(meta) is meta
    assert (meta.executor, meta.transport, meta.address) == ("producer", "shm", store.transport.address)
    assert (meta.dtype, meta.shape, meta.nbytes, meta.device) == ("bfloat16", [3, 5], 30, "cpu")
    assert meta.offset % 256 == 0
    assert decode_meta(encode_meta(meta)) == meta


def test_the_block_is_freed_only_at_the_last_release(store: TensorStore) -> None:
    store.put("r1/a", torch.ones(100), consumers=3, group="r1")
    used = store.stats()["used"]
    assert used > 0
    assert store.release("r1/a") is False
    assert store.release("r1/a") is False
    assert store.stats()["used"] == used
    assert store.release("r1/a") is True
    assert store.stats() | {"capacity": 0} == {
        "capacity": 0,
        "used": 0,
        "free": 64 * KIB,
        "largest_free": 64 * KIB,
        "tensors": 0,
        "copies": 0,
    }
    assert store.release("r1/a") is False  # a repeated release after a retry is harmless


def test_release_with_a_count_settles_several_consumers_at_once(store: TensorStore) -> None:
    store.put("r1/a", torch.ones(4), consumers=3, group="r1")
    assert store.release("r1/a", count=3) is True
    assert "r1/a" not in store


def test_opening_a_released_tensor_of_ours_raises_not_found(store: TensorStore) -> None:
    meta = store.put("r1/a", torch.ones(4), consumers=1, group="r1")
    store.release("r1/a")
    with pytest.raises(TensorNotFoundError) as caught:
        store.open(meta)
    assert caught.value.tensor_id == "r1/a"


def test_release_group_frees_every_tensor_of_a_cancelled_request(store: TensorStore) -> None:
    store.put("r1/a", torch.ones(4), consumers=2, group="r1")
    store.put("r1/b", torch.ones(400), consumers=5, group="r1")
    store.put("r2/a", torch.ones(4), consumers=1, group="r2")
    assert store.release_group("r1") == 2
    assert store.release_group("r1") == 0
    assert len(store) == 1 and "r2/a" in store
    assert store.release("r1/a") is False
    assert store.release("r2/a") is True
    assert store.stats()["used"] == 0


def test_discard_frees_a_tensor_whatever_its_readers_and_leaves_its_group_consistent(
    store: TensorStore,
) -> None:
    meta = store.put("r1/a", torch.ones(100), consumers=3, group="r1")
    store.put("r1/b", torch.ones(4), consumers=1, group="r1")
    used_b = store.stats()["used"] - store.transport.arena.block_size(meta.offset)
    assert store.release("r1/a") is False
    assert store.discard("r1/a") is True
    assert "r1/a" not in store and store.refcount("r1/a") == 0
    assert store.stats()["used"] == used_b
    assert store.discard("r1/a") is False  # unknown ids: nothing to do
    assert store.release("r1/a") is False  # a late consumer's release is harmless
    store.put("r1/a", torch.zeros(100), consumers=1, group="r1")  # the id can be stored again
    assert store.release_group("r1") == 2
    assert store.stats()["used"] == 0 and len(store) == 0


def test_put_of_an_existing_id_or_without_consumers_is_rejected(store: TensorStore) -> None:
    store.put("r1/a", torch.ones(4), consumers=1, group="r1")
    with pytest.raises(ValueError, match="already"):
        store.put("r1/a", torch.ones(4), consumers=1, group="r1")
    with pytest.raises(ValueError, match="consumers"):
        store.put("r1/b", torch.ones(4), consumers=0, group="r1")


def test_put_waits_for_space_and_proceeds_after_a_release_from_another_thread(store: TensorStore) -> None:
    half = torch.ones(8 * KIB)  # 32 KiB of float32: two fill the 64 KiB arena
    store.put("r1/a", half, consumers=1, group="r1")
    store.put("r1/b", half, consumers=1, group="r1")
    outcome: list[TensorMeta | BaseException] = []

    def put() -> None:
        try:
            outcome.append(store.put("r2/a", half * 2, consumers=1, group="r2"))
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which asserts on it
            outcome.append(exc)

    putter = threading.Thread(target=put)
    putter.start()
    assert store.transport.arena.wait_for_waiters(1, timeout=BOUND), "put never waited for space"
    assert not outcome
    assert store.release("r1/a") is True
    putter.join(timeout=BOUND)
    assert len(outcome) == 1 and isinstance(outcome[0], TensorMeta)
    with store.open(outcome[0]) as lease:
        assert torch.equal(lease.tensor, half * 2)


def test_put_fails_with_arena_full_when_no_space_comes_back(namespace: str) -> None:
    with ShmTransport(namespace, "small", 4 * KIB) as transport:
        store = TensorStore("small", transport, alloc_timeout=0.05)
        store.put("r1/a", torch.ones(1024), consumers=1, group="r1")
        with pytest.raises(ArenaFullError) as caught:
            store.put("r1/b", torch.ones(10), consumers=1, group="r1")
        assert caught.value.retryable
        with pytest.raises(ArenaFullError) as caught:
            store.put("r1/c", torch.ones(2048), consumers=1, group="r1")
        assert not caught.value.retryable
        assert len(store) == 1 and store.stats()["copies"] == 0


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    # Random bit patterns, NaN payloads and all: the round trip must be bitwise.
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize) if shape else (itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        torch.bool,
        torch.int64,
        torch.uint8,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
    ],
    ids=str,
)
def test_every_dtype_round_trips_bitwise_locally_and_through_a_peer(
    pair: tuple[TensorStore, TensorStore], dtype: torch.dtype
) -> None:
    producer, consumer = pair
    tensor = _random(dtype, (3, 5, 7))
    meta = producer.put("r1/x", tensor, consumers=1, group="r1")
    assert meta.dtype == dtype_name(dtype) and torch_dtype(meta.dtype) == dtype
    with producer.open(meta) as local:
        assert local.tensor.dtype == dtype and torch.equal(_bytes(local.tensor), _bytes(tensor))
    with consumer.open(meta) as pulled:
        assert not pulled.local and pulled.transferred_bytes == meta.nbytes and pulled.transfer_s >= 0
        assert pulled.tensor.dtype == dtype and list(pulled.tensor.shape) == [3, 5, 7]
        assert torch.equal(_bytes(pulled.tensor), _bytes(tensor))
    assert consumer.stats()["used"] == 0


def test_non_contiguous_scalar_and_empty_tensors_round_trip(pair: tuple[TensorStore, TensorStore]) -> None:
    producer, consumer = pair
    cases = {
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4, dtype=torch.float16),
    }
    for name, tensor in cases.items():
        meta = producer.put(name, tensor, consumers=1, group="r1")
        with consumer.open(meta) as lease:
            assert lease.tensor.shape == tensor.shape
            assert torch.equal(lease.tensor, tensor), name
        producer.release(name)
    assert producer.stats()["used"] == 0 and consumer.stats()["used"] == 0


def test_a_pulled_copy_is_freed_by_close_and_a_dropped_lease_once_its_tensors_are_gone(
    pair: tuple[TensorStore, TensorStore],
) -> None:
    producer, consumer = pair
    meta = producer.put("r1/x", torch.ones(1000), consumers=2, group="r1")
    lease = consumer.open(meta)
    assert consumer.stats()["copies"] == 1
    lease.close()
    lease.close()
    assert consumer.stats()["copies"] == 0
    with pytest.raises(ValueError, match="closed"):
        _ = lease.tensor

    kept = consumer.open(meta).tensor[10:20]  # a view outliving its (dropped) lease
    gc.collect()
    assert consumer.stats()["copies"] == 1, "the copy was freed while a tensor still views it"
    assert torch.equal(kept, torch.ones(10))
    del kept
    gc.collect()
    assert consumer.stats()["used"] == 0


def test_a_failed_pull_leaves_nothing_allocated(pair: tuple[TensorStore, TensorStore]) -> None:
    producer, consumer = pair
    meta = producer.put("r1/x", torch.ones(16), consumers=1, group="r1")
    producer.transport.close()
    with pytest.raises(TransportError) as caught:
        consumer.open(meta)
    assert caught.value.retryable
    assert consumer.stats()["used"] == 0


_GOOD = TensorMeta("t", "e", "shm", "seg", 0, 24, "float32", [2, 3])


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dtype": "float128"}, "dtype"),
        ({"offset": -256}, "offset"),
        ({"nbytes": 20}, "nbytes"),
        ({"shape": [2, -3], "nbytes": 24}, "shape[1]"),
        ({"shape": [True, 3], "nbytes": 12}, "shape[0]"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"tensor_id": ""}, "tensor_id"),
        ({"address": ""}, "address"),
    ],
)
def test_malformed_metadata_is_rejected_naming_the_field(
    store: TensorStore, changes: dict[str, object], field: str
) -> None:
    bad = msgspec.structs.replace(_GOOD, **changes)
    with pytest.raises(BadTensorMetaError) as caught:
        check_meta(bad)
    assert caught.value.field == field and not caught.value.retryable
    with pytest.raises(BadTensorMetaError):
        store.open(bad)
    assert store.stats()["used"] == 0


def test_metadata_off_the_wire_is_validated_and_tolerates_unknown_fields() -> None:
    wire = msgspec.msgpack.encode(msgspec.structs.asdict(_GOOD) | {"added_later": 1})
    assert decode_meta(wire) == _GOOD
    with pytest.raises(BadTensorMetaError):
        decode_meta(b"\x93not a meta")
    with pytest.raises(BadTensorMetaError):
        decode_meta(msgspec.msgpack.encode(msgspec.structs.asdict(_GOOD) | {"offset": "zero"}))


def test_concurrent_puts_opens_and_releases_neither_corrupt_nor_deadlock(store: TensorStore) -> None:
    # 4 threads x 24 KiB tensors (32 KiB blocks) in a 64 KiB arena: puts wait for each other.
    failures: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for step in range(25):
                tensor_id = f"w{index}/{step}"
                value = float(index * 100 + step)
                meta = store.put(tensor_id, torch.full((6 * KIB,), value), consumers=2, group=f"w{index}")
                with store.open(meta) as lease:
                    assert torch.all(lease.tensor == value), f"{tensor_id} was overwritten"
                store.release(tensor_id)
                assert store.release(tensor_id) is True
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which asserts on it
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=BOUND)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not failures, failures
    assert store.stats()["used"] == 0 and len(store) == 0


def test_make_transport_builds_host_transports_and_explains_nvshmem(namespace: str) -> None:
    with make_transport("shm", namespace=namespace, executor_id="e1", capacity=64 * KIB) as shm:
        assert (shm.kind, shm.address) == ("shm", f"t2i-{namespace}-e1")
    with make_transport("tcp", namespace=namespace, executor_id="e1", capacity=64 * KIB) as tcp:
        assert tcp.kind == "tcp" and tcp.address.startswith("127.0.0.1:")
    with pytest.raises(ValueError, match="NvshmemTransport"):
        make_transport("nvshmem", namespace=namespace, executor_id="e1", capacity=64 * KIB)
    with pytest.raises(ValueError, match="unknown"):
        make_transport("rdma", namespace=namespace, executor_id="e1", capacity=64 * KIB)


def test_the_nvshmem_transport_says_why_it_cannot_start_without_nvshmem_or_cuda() -> None:
    if importlib.util.find_spec("nvshmem") is not None and torch.cuda.is_available():
        pytest.skip("NVSHMEM and CUDA are present: covered by the nvshmem-marked tests")
    from libs.dataplane.transport.nvshmem import NvshmemTransport

    with pytest.raises(DataPlaneError, match="unavailable") as caught:
        NvshmemTransport(rank=0, nranks=1, capacity=1 << 20, exchange_uid=lambda uid: uid or b"")
    assert not caught.value.retryable


def test_a_pull_from_a_peer_copies_the_bytes_once_into_our_arena(
    pair: tuple[TensorStore, TensorStore],
) -> None:
    """Copies per pull (bench/dataplane.py reports them): 0 for a consumer on the producer's own
    executor, one for a peer of the box (shared memory) or of another box (TCP)."""
    producer, consumer = pair
    data = torch.arange(1024, dtype=torch.float32)
    meta = producer.put("r1/x", data, consumers=2, group="r1")
    with producer.open(meta) as own, consumer.open(meta) as pulled:
        assert own.copies == 0 and own.tensor.data_ptr() != 0
        assert pulled.copies == 1 and not pulled.local and torch.equal(pulled.tensor, data)
        assert consumer.stats()["copies"] == 1  # the one copy is a block of the consumer's arena
