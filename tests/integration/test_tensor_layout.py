"""A tensor keeps its memory layout through the data plane (``TensorMeta.strides``): a consumer gets
the strides the producer's tensor had, not a C-contiguous copy. Kernels choose their paths by layout
(the CPU's convolutions round differently on channels-last input), so a workflow whose VAE encoder
hands a channels-last latent on differed by a bit from its pipeline once a node ran on another
executor (``tests/e2e/test_edits_e2e.py``, Z-Image inpainting)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from libs.dataplane.store import TensorStore
from libs.dataplane.transport import ShmTransport, TcpTransport, Transport
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import TensorMeta, check_meta, decode_meta, encode_meta

CAPACITY = 1 << 20


def _transport(kind: str, namespace: str, executor: str) -> Transport:
    if kind == "shm":
        return ShmTransport(namespace, executor, CAPACITY)
    return TcpTransport("127.0.0.1", 0, capacity=CAPACITY)


@pytest.fixture(params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TensorStore, TensorStore]]:
    """A producer's and a consumer's store on their own arenas, over one transport kind."""
    namespace = f"test{uuid.uuid4().hex[:8]}"
    producer = _transport(request.param, namespace, "producer")
    consumer = _transport(request.param, namespace, "consumer")
    try:
        yield (
            TensorStore("producer", producer, alloc_timeout=30),
            TensorStore("consumer", consumer, alloc_timeout=30),
        )
    finally:
        consumer.close()
        producer.close()
        for leftover in Path("/dev/shm").glob(f"t2i-{namespace}-*"):
            os.unlink(leftover)


def latent() -> torch.Tensor:
    """A channels-last latent, as a VAE encoder's convolutions leave it on the CPU."""
    return torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)).to(
        memory_format=torch.channels_last
    )


def test_dense_layouts_arrive_with_the_producers_strides_pulled_or_viewed(pair) -> None:
    producer, consumer = pair
    cases = {
        "channels_last": latent(),
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        # a dim of size 1 with a stride C-contiguity would not give it (what a squeeze can leave)
        "odd_unit_stride": torch.arange(12.0).as_strided((4, 1, 3), (3, 7, 1)),
        "contiguous": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    for name, tensor in cases.items():
        meta = producer.put(name, tensor, consumers=2, group="r1")
        assert (meta.strides is None) == (name == "contiguous"), name
        for store in (consumer, producer):  # a pull from the peer, then the producer's own view
            with store.open(meta) as lease:
                assert lease.tensor.stride() == tensor.stride(), (name, store.executor_id)
                assert torch.equal(lease.tensor, tensor), name
        producer.release(name, 2)
    assert producer.stats()["used"] == 0 and consumer.stats()["used"] == 0


def test_a_view_with_gaps_arrives_dense_with_its_dims_in_the_same_order(pair) -> None:
    producer, consumer = pair
    tensor = latent()[:, :2]  # channels-last, every other channel gone: not dense
    meta = producer.put("sliced", tensor, consumers=1, group="r1")
    with consumer.open(meta) as lease:
        assert lease.tensor.stride() == torch.empty_like(tensor).stride() == (128, 1, 16, 2)
        assert lease.tensor.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(lease.tensor, tensor)
    producer.release("sliced")


def test_a_convolution_of_the_pulled_latent_equals_the_producers_bit_for_bit(pair) -> None:
    producer, consumer = pair
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(4, 8, 3, padding=1)
    tensor = latent()
    meta = producer.put("latent", tensor, consumers=1, group="r1")
    with consumer.open(meta) as lease, torch.no_grad():
        assert torch.equal(conv(lease.tensor), conv(tensor))
    producer.release("latent")


def test_strides_travel_on_the_wire_and_metadata_without_them_is_c_contiguous() -> None:
    meta = TensorMeta("t", "e", "shm", "seg", 0, 64, "float32", [1, 4, 2, 2], strides=[16, 1, 8, 4])
    assert decode_meta(encode_meta(meta)).strides == [16, 1, 8, 4]
    legacy = msgspec.msgpack.encode({k: v for k, v in msgspec.structs.asdict(meta).items() if k != "strides"})
    assert decode_meta(legacy).strides is None


@pytest.mark.parametrize(
    ("shape", "strides"),
    [
        ([4, 4], [8, 1]),  # gaps: the view would reach past the block
        ([4, 4], [4, 4]),  # overlapping
        ([4, 4], [0, 1]),  # broadcast
        ([4, 4], [4]),  # one stride short
        ([4, 4], [4, -1]),
        ([4, 4], [4, True]),
    ],
)
def test_strides_that_are_not_a_dense_layout_are_refused(shape, strides) -> None:
    nbytes = 4 * shape[0] * shape[1]
    with pytest.raises(BadTensorMetaError, match="strides"):
        check_meta(TensorMeta("t", "e", "shm", "seg", 0, nbytes, "float32", shape, strides=strides))
