"""Suffix loads (layer-prefix caching, the paper's §5.1) and per-layer load times.

``Loader.load(..., first_layer=k)`` reads only the chunks from the one holding layer ``k``'s start
(and those holding tensors of the suffix tied to an earlier layer); the suffix's tensors are bitwise
those of a full load, the prefix's events are set at once. ``LoadedCheckpoint.layer_seconds`` says
when each layer's event was set.

The checkpoints are written with ``write_checkpoint`` (as ``test_loader.py`` does; diffusers is not
needed) from a small transformer-like model built from a config with random weights: a patch
embedding, a ModuleList of blocks of several chunks each, a norm and a head (tied to the embedding
in one variant).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.dataplane.checkpoint import Index, ModelInfo, Source, read_index, write_checkpoint
from libs.dataplane.errors import CorruptCheckpoint
from libs.dataplane.loader import Loader, _segments, device_layout, views
from libs.dataplane.loader.layout import needed_chunks, needed_ranges

KIB = 1024
CHUNK = 16 * KIB
CONFIG = {"vocab": 64, "dim": 64, "mlp_ratio": 4, "layers": 6, "tie_head": False}


class Block(torch.nn.Module):
    def __init__(self, dim: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, dim * mlp_ratio)
        self.down = torch.nn.Linear(dim * mlp_ratio, dim)


class TinyDiT(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, mlp_ratio: int, layers: int, tie_head: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, mlp_ratio) for _ in range(layers))
        self.norm_out = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        if tie_head:
            self.head.weight = self.embed.weight  # stored once, with the embedding


def build(**overrides: Any) -> TinyDiT:
    torch.manual_seed(0)
    made = TinyDiT(**(CONFIG | overrides))
    with torch.no_grad():
        for p in made.parameters():
            p.normal_()  # random weights, no byte range left zero
    return made.eval()


def convert(model: TinyDiT, out: Path) -> Path:
    out.mkdir(parents=True)
    source = Source(files=[], model_class="test.TinyDiT", dtype="native", library_version="0")
    # Two partitions, so a suffix can start in the second one.
    write_checkpoint(
        model,
        out,
        source,
        ModelInfo("test", "TinyDiT", "float32"),
        chunk_bytes=CHUNK,
        partition_bytes=512 * KIB,
    )
    return out


@pytest.fixture(scope="module")
def model() -> TinyDiT:
    return build()


@pytest.fixture
def ckpt(model: TinyDiT, tmp_path: Path) -> Path:
    return convert(model, tmp_path / "tiny-dit" / ".t2i-ckpt" / "native")


@pytest.fixture
def loader() -> Iterator[Loader]:
    with Loader(disk_threads=4, chunk_bytes=CHUNK) as made:
        yield made


def layer_index(index: Index, name: str) -> int:
    return [layer.name for layer in index.layers].index(name)


def suffix_tensors(index: Index, first_layer: int) -> list[str]:
    names = {layer.name for layer in index.layers[first_layer:]}
    return [t.name for t in index.tensors if t.layer in names]


def chunk_bytes_from(index: Index, start: int) -> int:
    """The bytes of the chunks overlapping ``[start, total_bytes)``: what a suffix load reads."""
    return sum(c.nbytes for c in Loader._chunks(None, index) if c.flat + c.nbytes > start)  # type: ignore[arg-type]


# -- what a suffix load reads and gives --------------------------------------------------------------


def test_a_suffix_load_gives_the_suffix_tensors_bitwise_and_reads_from_the_chunk_holding_its_start(
    ckpt: Path, loader: Loader
) -> None:
    index = read_index(ckpt)
    assert len(index.partitions) == 2
    full = loader.load(ckpt)
    assert full.bytes_from_disk == index.total_bytes and full.first_layer == 0
    # a block in the first partition, one starting in the second, the last one with bytes
    starts = [layer_index(index, "blocks.1"), layer_index(index, "blocks.4"), layer_index(index, "norm_out")]
    assert index.layers[starts[1]].start >= index.partitions[0].nbytes
    for k in starts:
        before = loader.disk_bytes
        loaded = loader.load(ckpt, first_layer=k)
        assert loaded.done() and loaded.error is None and loaded.first_layer == k
        start = index.layers[k].start
        # chunk-granular: from the chunk holding the suffix's start to the end, nothing before it
        assert loaded.bytes_from_disk == chunk_bytes_from(index, start) == loader.disk_bytes - before
        assert index.total_bytes - start <= loaded.bytes_from_disk < full.bytes_from_disk
        names = suffix_tensors(index, k)
        assert names
        for name in names:
            assert torch.equal(loaded.tensors[name], full.tensors[name]), name
        # the buffer keeps its full size: every tensor (prefix ones too) at its full-load place
        base, full_base = (x.tensors["embed.weight"].untyped_storage().data_ptr() for x in (loaded, full))
        for name, t in loaded.tensors.items():
            assert t.shape == full.tensors[name].shape and t.dtype == full.tensors[name].dtype
            assert t.data_ptr() - base == full.tensors[name].data_ptr() - full_base, name
        assert all(ev.is_set() for ev in loaded.layer_ready.values())
    assert loader.loads == 1 + len(starts)


def test_a_suffix_with_a_tensor_tied_to_an_earlier_layer_also_reads_the_tied_bytes(
    loader: Loader, tmp_path: Path
) -> None:
    model = build(tie_head=True)
    ckpt = convert(model, tmp_path / "tied")
    index = read_index(ckpt)
    head = next(t for t in index.tensors if t.name == "head.weight")
    assert head.alias_of == "embed.weight"  # layer "head" holds only this alias: its bytes are embed's
    full = loader.load(ckpt)
    for k in (layer_index(index, "blocks.2"), layer_index(index, "head")):
        loaded = loader.load(ckpt, first_layer=k)
        for name in suffix_tensors(index, k):
            assert torch.equal(loaded.tensors[name], full.tensors[name]), name
        assert torch.equal(loaded.tensors["head.weight"], model.head.weight.detach())
        assert loaded.tensors["head.weight"] is loaded.tensors["embed.weight"]
        start = index.layers[k].start
        assert needed_ranges(index, k) == [
            (head.offset, head.offset + head.nbytes),
            (start, index.total_bytes),
        ]
        tied = sum(
            c.nbytes
            for c in loader._chunks(index)
            if c.flat < head.offset + head.nbytes and c.flat + c.nbytes > head.offset
        )
        assert loaded.bytes_from_disk == chunk_bytes_from(index, start) + tied < index.total_bytes


def test_a_suffix_load_of_a_converted_diffusers_transformer_equals_its_from_pretrained_weights(
    tmp_path: Path, loader: Loader
) -> None:
    diffusers = pytest.importorskip("diffusers")
    from libs.dataplane.checkpoint import convert as convert_component

    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )  # fmt: skip
    model.save_pretrained(tmp_path / "transformer")
    ckpt = convert_component(tmp_path / "transformer", chunk_bytes=CHUNK)
    index = read_index(ckpt)
    want = dict(model.named_parameters(remove_duplicate=False)) | dict(
        model.named_buffers(remove_duplicate=False)
    )
    k = layer_index(index, "single_transformer_blocks.0")
    loaded = loader.load(ckpt, first_layer=k)
    names = suffix_tensors(index, k)
    assert any(n.startswith("proj_out.") for n in names)
    for name in names:
        assert torch.equal(loaded.tensors[name], want[name].detach()), name
    assert loaded.bytes_from_disk == chunk_bytes_from(index, index.layers[k].start) < index.total_bytes


def test_the_needed_chunks_are_those_overlapping_the_needed_ranges(ckpt: Path) -> None:
    index = read_index(ckpt)
    chunks = Loader._chunks(None, index)  # type: ignore[arg-type]
    assert needed_ranges(index, 0) == [(0, index.total_bytes)]
    assert all(needed_chunks(chunks, needed_ranges(index, 0)))
    assert needed_ranges(index, len(index.layers)) == []
    assert not any(needed_chunks(chunks, []))
    k = layer_index(index, "blocks.2")
    start = index.layers[k].start
    flags = needed_chunks(chunks, needed_ranges(index, k))
    assert flags == [c.flat + c.nbytes > start for c in chunks]
    first = flags.index(True)
    assert chunks[first].flat <= start < chunks[first].flat + chunks[first].nbytes
    overlapping = [(0, 10), (5, CHUNK + 1), (3 * CHUNK - 1, 3 * CHUNK)]
    assert needed_chunks(chunks[:4], overlapping) == [True, True, True, False]


def test_the_cuda_copy_plan_of_the_needed_chunks_rebuilds_every_suffix_tensor(
    ckpt: Path, loader: Loader
) -> None:
    # What the CUDA stage of a suffix load does (segments of the needed chunks only, into a full-size
    # device buffer), done here on the CPU.
    index = read_index(ckpt)
    full = loader.load(ckpt)
    host_flat = torch.empty(0, dtype=torch.uint8).set_(full.tensors["embed.weight"].untyped_storage())
    offsets, size = device_layout(index)
    for k in (layer_index(index, "blocks.3"), layer_index(index, "head")):
        every = loader._chunks(index)
        chunks = [c for c, n in zip(every, needed_chunks(every, needed_ranges(index, k)), strict=True) if n]
        device = torch.full((size,), 0xAB, dtype=torch.uint8)
        for chunk, pieces in zip(chunks, _segments(index, chunks, offsets), strict=True):
            src = host_flat[chunk.flat : chunk.flat + chunk.nbytes]
            for a, b, at in pieces:
                device[at : at + b - a].copy_(src[a:b])
        rebuilt = views(index, device, offsets)
        for name in suffix_tensors(index, k):
            assert torch.equal(rebuilt[name], full.tensors[name]), name


# -- layer events and times --------------------------------------------------------------------------


def test_the_prefix_layers_are_ready_at_once_and_the_suffix_layers_as_their_bytes_land(
    ckpt: Path, loader: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = read_index(ckpt)
    k = layer_index(index, "blocks.3")
    gate = threading.Event()
    real_preadv = os.preadv

    def held_preadv(fd: int, buffers: Any, offset: int) -> int:
        assert gate.wait(30)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", held_preadv)
    loaded = loader.tagged(["m"]).load(ckpt, background=True, first_layer=k)  # the view passes it on
    try:
        assert not loaded.done()
        for layer in index.layers[:k]:
            assert loaded.layer_ready[layer.name].is_set() and loaded.layer_seconds[layer.name] == 0.0
        for layer in index.layers[k:]:
            assert not loaded.layer_ready[layer.name].is_set() and layer.name not in loaded.layer_seconds
        loaded.wait_layer(index.layers[k - 1].name, 0)  # does not block
    finally:
        gate.set()
    loaded.wait(30)
    assert all(ev.is_set() for ev in loaded.layer_ready.values())


@pytest.mark.parametrize("suffix", [False, True], ids=["full", "suffix"])
def test_layer_seconds_has_every_layer_in_non_decreasing_layer_order(
    ckpt: Path, loader: Loader, suffix: bool
) -> None:
    index = read_index(ckpt)
    k = layer_index(index, "blocks.2") if suffix else 0
    loaded = loader.load(ckpt, first_layer=k)
    times = [loaded.layer_seconds[layer.name] for layer in index.layers]
    assert list(loaded.layer_seconds) == [layer.name for layer in index.layers]
    assert times == sorted(times) and all(t >= 0.0 for t in times)
    assert times[:k] == [0.0] * k and times[-1] > 0.0
    assert times[-1] <= loaded.seconds + 1.0


# -- limits -----------------------------------------------------------------------------------------


def test_first_layer_out_of_range_raises_and_past_the_last_layer_loads_nothing(
    ckpt: Path, loader: Loader
) -> None:
    index = read_index(ckpt)
    n = len(index.layers)
    for bad in (-1, n + 1):
        with pytest.raises(ValueError, match="first_layer"):
            loader.load(ckpt, first_layer=bad)
    assert (loader.loads, loader.disk_bytes) == (0, 0)
    loaded = loader.load(ckpt, first_layer=n)
    assert loaded.done() and loaded.error is None and loaded.bytes_from_disk == 0 == loader.disk_bytes
    assert set(loaded.tensors) == {t.name for t in index.tensors}
    assert all(ev.is_set() for ev in loaded.layer_ready.values())
    assert set(loaded.layer_seconds.values()) == {0.0}


def test_a_corrupt_chunk_in_the_suffix_fails_the_load_and_one_in_the_prefix_is_never_read(
    ckpt: Path, loader: Loader
) -> None:
    index = read_index(ckpt)
    k = layer_index(index, "blocks.4")  # in the second partition
    start = index.layers[k].start - index.partitions[0].nbytes
    part = ckpt / index.partitions[1].file
    data = bytearray(part.read_bytes())
    data[start + 100] ^= 0x01  # in the suffix
    part.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint) as caught:
        loader.load(ckpt, first_layer=k)
    assert caught.value.partition == 1 and "CRC32" in caught.value.reason
    data[start + 100] ^= 0x01
    data[0] ^= 0x01  # the first chunk of partition 1: before the suffix's chunks
    assert start >= CHUNK
    part.write_bytes(bytes(data))
    loader.load(ckpt, first_layer=k)  # not read, not checked
    with pytest.raises(CorruptCheckpoint):
        loader.load(ckpt)


# -- host tier ---------------------------------------------------------------------------------------


def test_a_load_bypassing_the_host_tier_leaves_it_untouched_and_a_miss_fills_the_whole_entry(
    ckpt: Path, tmp_path: Path
) -> None:
    from libs.dataplane.hosttier import HostTier

    index = read_index(ckpt)
    k = layer_index(index, "blocks.3")
    name = f"t{uuid.uuid4().hex[:10]}"
    tier = HostTier(name, 64 << 20, tmp_path)
    try:
        with Loader(tier, chunk_bytes=CHUNK) as loader:
            stats = tier.stats()
            private = loader.load(ckpt, first_layer=k, use_host_tier=False)
            again = loader.tagged(["m"]).load(ckpt, use_host_tier=False)
            assert tier.stats() == stats and tier.tags() == set()
            assert (private.source, private.host_block, again.source) == ("disk", None, "disk")
            assert private.bytes_from_disk == chunk_bytes_from(index, index.layers[k].start)
            assert loader.host_hits == 0

            miss = loader.load(ckpt, first_layer=k)  # fills the whole entry, so the next load hits
            assert miss.source == "disk" and miss.bytes_from_disk == index.total_bytes
            hit = loader.load(ckpt, first_layer=k)
            assert hit.source == "host" and hit.bytes_from_disk == 0
            assert (tier.stats()["fills"], tier.stats()["hits"], loader.host_hits) == (1, 1, 1)
            for name_ in suffix_tensors(index, k):
                assert torch.equal(hit.tensors[name_], again.tensors[name_]), name_
                assert torch.equal(private.tensors[name_], again.tensors[name_]), name_
            assert all(hit.layer_seconds[layer.name] == 0.0 for layer in index.layers[:k])
            assert set(hit.layer_seconds) == {layer.name for layer in index.layers}
            for loaded in (private, again, miss, hit):
                loaded.close()
    finally:
        tier.close()
        HostTier.destroy(name, tmp_path)


# -- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tiered", [False, True], ids=["staging", "host-tier"])
def test_a_cuda_suffix_load_copies_only_the_suffix_and_records_its_layers_events(
    ckpt: Path, model: TinyDiT, tiered: bool
) -> None:
    from tests.unit.test_loader import FakeHostTier

    index = read_index(ckpt)
    k = layer_index(index, "blocks.3")
    want = dict(model.named_parameters(remove_duplicate=False))
    with Loader(FakeHostTier() if tiered else None, chunk_bytes=CHUNK) as loader:
        for expected in ("disk", "host") if tiered else ("disk", "disk"):
            loaded = loader.load(ckpt, device="cuda", first_layer=k)
            assert loaded.source == expected
            assert all(t.device.type == "cuda" for t in loaded.tensors.values())
            for name in suffix_tensors(index, k):
                assert torch.equal(loaded.tensors[name].cpu(), want[name].detach()), name
            assert set(loaded.cuda_events) == {layer.name for layer in index.layers[k:]}
            loaded.close()
