"""The loader: converted checkpoints from disk (O_DIRECT, or buffered where refused) or a host tier
into views of one flat buffer, chunk CRCs checked as they land, layers reported ready in order.

These tests write checkpoints of a small hand-built module with ``write_checkpoint`` (no diffusers):
a ModuleList of blocks, a tied weight, non-persistent, 0-dim, bool, bf16 and empty buffers. The
round trip through real ``from_pretrained`` components is ``test_checkpoint.py``'s.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.dataplane.checkpoint import (
    ADDRESS_MODULUS,
    PAGE,
    ModelInfo,
    Source,
    read_index,
    write_checkpoint,
)
from libs.dataplane.errors import CorruptCheckpoint, DataPlaneError
from libs.dataplane.loader import DEVICE_ALIGN, Loader, _segments, buffer_address, device_layout, views

KIB = 1024


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("scale", torch.randn(d).to(torch.bfloat16), persistent=False)


class Toy(torch.nn.Module):
    def __init__(self, d: int = 128, n: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 100, bias=False)
        self.head.weight = self.embed.weight  # tied: stored once
        self.register_buffer("step", torch.tensor(3))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("empty", torch.empty(0), persistent=False)


def every_tensor(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(
        model.named_buffers(remove_duplicate=False)
    )


def write(
    model: torch.nn.Module, out: Path, chunk_bytes: int = 4 * KIB, partition_bytes: int = 1 << 30
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    source = Source(files=[], model_class="test.Toy", dtype="native", library_version="0")
    write_checkpoint(
        model,
        out,
        source,
        ModelInfo("test", "Toy", "float32"),
        chunk_bytes=chunk_bytes,
        partition_bytes=partition_bytes,
    )
    return out


@pytest.fixture(scope="module")
def toy() -> Toy:
    torch.manual_seed(0)
    return Toy()


@pytest.fixture
def ckpt(toy: Toy, tmp_path: Path) -> Path:
    return write(toy, tmp_path / "ckpt", partition_bytes=96 * KIB)


@pytest.fixture
def loader() -> Iterator[Loader]:
    with Loader(disk_threads=4, chunk_bytes=4 * KIB) as made:
        yield made


def assert_same(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    want = every_tensor(model)
    assert set(tensors) == set(want)
    for name, t in want.items():
        got = tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.cpu(), t.detach()), name


class FakeHostTier:
    """The host tier's API in one process, as strict as the real one is about buffers: a miss fills
    a mapping of its own (which must be closable after ``fill``: the loader keeps no view of it)
    and copies it into the box; blocks map the box (read-only with ``read_only``); ``offset``
    places a block that far into its mapping (an unaligned buffer)."""

    class Block:
        def __init__(self, tier: FakeHostTier, key: str, buf: memoryview, hit: bool) -> None:
            self.tier, self.key, self.buf, self.hit = tier, key, buf, hit

        def close(self) -> None:
            self.tier.closed.append(self.key)

    def __init__(self, offset: int = 0, read_only: bool = False) -> None:
        self.offset = offset
        self.read_only = read_only
        self.boxes: dict[str, mmap.mmap] = {}
        self.fills: list[str] = []
        self.closed: list[str] = []
        self.tags: list[list[str]] = []
        self.lock = threading.Lock()

    def _buf(self, mem: mmap.mmap, nbytes: int) -> memoryview:
        view = memoryview(mem)[self.offset : self.offset + nbytes]
        return view.toreadonly() if self.read_only else view

    def get_or_fill(
        self, key: str, nbytes: int, fill: Callable[[memoryview], None], tags: Iterable[str] = ()
    ) -> Any:
        with self.lock:
            self.tags.append(sorted(tags))
            if key in self.boxes:
                return self.Block(self, key, self._buf(self.boxes[key], nbytes), True)
            filling = mmap.mmap(-1, max(PAGE, nbytes + self.offset))
            view = memoryview(filling)[self.offset : self.offset + nbytes]
            self.fills.append(key)
            try:
                fill(view)  # raises: the box is not kept
            finally:
                view.release()
            box = mmap.mmap(-1, len(filling))
            box[:] = filling[:]
            filling.close()  # BufferError if the loader kept a view of the fill's buffer
            self.boxes[key] = box
            return self.Block(self, key, self._buf(box, nbytes), False)


# -- disk -> host ------------------------------------------------------------------------------------


def test_a_load_gives_every_tensor_bitwise_as_views_of_one_buffer_with_ties_kept(
    toy: Toy, ckpt: Path, loader: Loader
) -> None:
    loaded = loader.load(ckpt)
    assert loaded.done() and loaded.error is None and loaded.source == "disk"
    assert_same(toy, loaded.tensors)
    assert loaded.tensors["head.weight"] is loaded.tensors["embed.weight"]
    base = loaded.tensors["embed.weight"].untyped_storage().data_ptr()
    assert all(
        t.untyped_storage().data_ptr() == base for t in loaded.tensors.values()
    )  # zero copy: one flat buffer
    index = read_index(ckpt)
    assert len(index.partitions) > 1 and all(p.nbytes % PAGE == 0 for p in index.partitions)
    # each tensor keeps its address modulo a page (the kernels' alignment) from the source model
    for name, t in every_tensor(toy).items():
        if t.numel():
            assert loaded.tensors[name].data_ptr() % ADDRESS_MODULUS == t.data_ptr() % ADDRESS_MODULUS, name
    assert loaded.bytes_from_disk == index.total_bytes == loader.disk_bytes
    assert (loader.loads, loader.host_hits) == (1, 0)
    assert all(ev.is_set() for ev in loaded.layer_ready.values())


def test_the_layout_is_in_layer_order_and_layers_are_ready_in_that_order(toy: Toy, ckpt: Path) -> None:
    index = read_index(ckpt)
    names = [layer.name for layer in index.layers]
    # a module's own tensors come before its children's (module order: parents first)
    assert names == ["step", "mask", "empty", "embed", *(f"blocks.{i}" for i in range(6)), "norm", "head"]
    assert [layer.start for layer in index.layers] == sorted(layer.start for layer in index.layers)
    for a, b in zip(index.layers, index.layers[1:], strict=False):
        assert a.end <= b.start or b.start == b.end
    bases = index.partition_bases()
    spans = {layer.name: layer for layer in index.layers}
    for t in index.tensors:
        if t.alias_of is None:
            lo = bases[t.partition] + t.offset
            assert spans[t.layer].start <= lo and lo + t.nbytes <= spans[t.layer].end, t.name
    head = next(t for t in index.tensors if t.name == "head.weight")
    assert head.alias_of == "embed.weight" and spans["head"].start == spans["head"].end
    # Layers become ready in order: whenever one is set, every layer before it already is.
    for _ in range(3):
        with Loader(disk_threads=4, chunk_bytes=4 * KIB) as loader:
            loaded = loader.load(ckpt, background=True)
            out_of_order: list[str] = []
            events = list(loaded.layer_ready.items())

            def watch(i: int, events: list[tuple[str, threading.Event]], out_of_order: list[str]) -> None:
                events[i][1].wait()
                if not all(ev.is_set() for _, ev in events[:i]):
                    out_of_order.append(events[i][0])

            watchers = [
                threading.Thread(target=watch, args=(i, events, out_of_order)) for i in range(len(events))
            ]
            for w in watchers:
                w.start()
            loaded.wait(30)
            for w in watchers:
                w.join(30)
            assert out_of_order == []
            assert_same(toy, loaded.tensors)


def test_o_direct_is_used_where_the_filesystem_allows_it_and_tmpfs_falls_back_to_buffered_reads(
    toy: Toy, tmp_path: Path, loader: Loader
) -> None:
    disk = write(toy, tmp_path / "disk")
    try:
        os.close(os.open(disk / "part-000.bin", os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert_same(toy, loader.load(disk).tensors)
    shm = Path("/dev/shm") / f"t2i-test-ckpt-{uuid.uuid4().hex[:8]}"
    try:
        write(toy, shm)  # tmpfs: refuses O_DIRECT before Linux 6.6, accepts it since
        assert_same(toy, loader.load(shm).tensors)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_filesystem_refusing_o_direct_at_open_or_at_read_is_read_buffered(
    toy: Toy, ckpt: Path, loader: Loader, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stands in for a filesystem that refuses O_DIRECT (EINVAL), whatever this machine's kernel does.
    real_open, real_preadv = os.open, os.preadv
    refused = {"open": 0, "read": 0}

    def open_refusing(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT and "part-000" in str(path):
            refused["open"] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def preadv_refusing(fd: int, buffers: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused["read"] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", open_refusing)
    monkeypatch.setattr(os, "preadv", preadv_refusing)
    assert_same(toy, loader.load(ckpt).tensors)
    assert refused["open"] == 1 and refused["read"] >= 1  # other partitions opened O_DIRECT, read buffered


def test_a_checkpoint_written_in_other_chunks_loads_with_any_loader(toy: Toy, tmp_path: Path) -> None:
    ckpt = write(toy, tmp_path / "big-chunks", chunk_bytes=64 * KIB)
    with Loader(disk_threads=2) as loader:  # 16 MiB staging chunks: reads follow the index's
        assert_same(toy, loader.load(ckpt).tensors)


def test_the_device_layout_is_aligned_and_the_chunk_pieces_rebuild_every_tensor(
    toy: Toy, ckpt: Path, loader: Loader
) -> None:
    # What the CUDA stage does with each landed chunk, done here on the CPU: the copy plan is the same.
    index = read_index(ckpt)
    host = loader.load(ckpt)
    storage = host.tensors["embed.weight"].untyped_storage()  # the flat host buffer
    host_flat = torch.empty(0, dtype=torch.uint8).set_(storage)[: index.total_bytes]
    offsets, size = device_layout(index)
    assert all(at % DEVICE_ALIGN == 0 for at in offsets.values())
    device = torch.full((size,), 0xAB, dtype=torch.uint8)
    chunks = loader._chunks(index)
    for chunk, pieces in zip(chunks, _segments(index, chunks, offsets), strict=True):
        src = host_flat[chunk.flat : chunk.flat + chunk.nbytes]
        for a, b, at in pieces:
            device[at : at + b - a].copy_(src[a:b])
    rebuilt = views(index, device, offsets)
    assert_same(toy, rebuilt)
    assert rebuilt["head.weight"] is rebuilt["embed.weight"]


# -- corruption --------------------------------------------------------------------------------------


def test_a_flipped_byte_fails_the_load_with_its_partition_and_chunk(ckpt: Path, loader: Loader) -> None:
    index = read_index(ckpt)
    part = ckpt / index.partitions[1].file
    data = bytearray(part.read_bytes())
    data[5000] ^= 0x01
    part.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint) as caught:
        loader.load(ckpt)
    assert caught.value.partition == 1 and "chunk 1" in caught.value.reason and "CRC32" in caught.value.reason
    assert isinstance(caught.value, DataPlaneError)
    loaded = loader.load(ckpt, background=True)
    with pytest.raises(CorruptCheckpoint):
        loaded.wait(30)
    with pytest.raises(CorruptCheckpoint):  # waiters on layers wake up and see the failure
        loaded.wait_layer(index.layers[-1].name, 30)


def test_a_truncated_partition_fails_the_load_before_anything_is_read(ckpt: Path, loader: Loader) -> None:
    index = read_index(ckpt)
    part = ckpt / index.partitions[0].file
    os.truncate(part, index.partitions[0].nbytes - PAGE)
    with pytest.raises(CorruptCheckpoint) as caught:
        loader.load(ckpt)
    assert caught.value.partition == 0 and "truncated" in caught.value.reason
    assert loader.disk_bytes == 0


# -- host tier ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "read_only"),
    [(0, False), (512, False), (0, True)],
    ids=["page-aligned", "unaligned", "read-only"],
)
def test_the_host_tier_is_filled_once_from_disk_and_then_hit_by_every_other_loader(
    toy: Toy, ckpt: Path, offset: int, read_only: bool
) -> None:
    tier = FakeHostTier(offset, read_only)
    with Loader(tier, chunk_bytes=4 * KIB) as first, Loader(tier, chunk_bytes=4 * KIB) as second:
        a = first.load(ckpt)
        b = second.load(ckpt)  # another executor of the box
        assert (a.source, b.source) == ("disk", "host")
        assert tier.fills == [a.key] and a.key == b.key
        assert a.bytes_from_disk == read_index(ckpt).total_bytes and b.bytes_from_disk == 0
        assert (first.host_hits, second.host_hits, second.disk_bytes) == (0, 1, 0)
        assert_same(toy, a.tensors)
        assert_same(toy, b.tensors)
        index = read_index(ckpt)
        embed = next(t for t in index.tensors if t.name == "embed.weight")
        address = buffer_address(tier.boxes[a.key]) + offset  # the tier's memory is the model's: no copy
        assert b.tensors["embed.weight"].data_ptr() == address + index.flat_offset(embed)
        assert tier.tags[0] == [f"ckpt:{ckpt.parent.parent}"]
        assert tier.closed == []
        a.close()
        b.close()
        b.close()
        assert tier.closed == [a.key, b.key]


def test_a_tagged_loader_adds_its_tags_and_shares_the_counters(ckpt: Path) -> None:
    tier = FakeHostTier()
    with Loader(tier, chunk_bytes=4 * KIB, tags=["box"]) as loader:
        view = loader.tagged(["flux.vae|tiny-flux"])
        view.load(ckpt, tags=["extra"])
        view.close()  # the view's close leaves the loader open
        assert loader.load(ckpt).source == "host"
        assert (
            (view.loads, view.host_hits, view.chunk_bytes)
            == (loader.loads, loader.host_hits, 4 * KIB)
            == (2, 1, 4 * KIB)
        )
        assert loader.disk_bytes == view.disk_bytes == read_index(ckpt).total_bytes
    assert tier.tags[0] == sorted(["box", "extra", "flux.vae|tiny-flux", f"ckpt:{ckpt.parent.parent}"])


def test_a_corrupt_fill_leaves_nothing_in_the_host_tier(ckpt: Path) -> None:
    index = read_index(ckpt)
    part = ckpt / index.partitions[0].file
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    tier = FakeHostTier()
    with Loader(tier, chunk_bytes=4 * KIB) as loader:
        with pytest.raises(CorruptCheckpoint):
            loader.load(ckpt)
        assert tier.boxes == {} and len(tier.fills) == 1


def test_a_background_load_through_the_host_tier_returns_with_the_tensors_and_finishes(
    toy: Toy, ckpt: Path
) -> None:
    tier = FakeHostTier()
    with Loader(tier, chunk_bytes=4 * KIB) as loader:
        loaded = loader.load(ckpt, background=True)
        assert set(loaded.tensors) == set(every_tensor(toy))
        loaded.wait(30)
        assert_same(toy, loaded.tensors)
        hit = loader.load(ckpt, background=True).wait(30)
        assert hit.source == "host"
        assert_same(toy, hit.tensors)


def test_the_real_host_tier_shares_one_copy_between_loaders_in_either_access_mode(
    toy: Toy, ckpt: Path, tmp_path: Path
) -> None:
    from libs.dataplane.hosttier import HostTier

    for access in ("copy", "read"):
        name = f"t{uuid.uuid4().hex[:10]}"
        tiers = [HostTier(name, 64 << 20, tmp_path, block_access=access) for _ in range(2)]
        try:
            with (
                Loader(tiers[0], chunk_bytes=4 * KIB) as first,
                Loader(tiers[1], chunk_bytes=4 * KIB) as second,
            ):
                a = first.load(ckpt, tags=["model-a"])
                b = second.load(ckpt)
                assert (a.source, b.source) == ("disk", "host")
                assert_same(toy, a.tensors)
                assert_same(toy, b.tensors)
                assert tiers[1].tags() == {"model-a", f"ckpt:{ckpt.parent.parent}"}
                stats = tiers[0].stats()
                assert (stats["fills"], stats["hits"], stats["leased_entries"]) == (1, 1, 1)
                a.close()
                b.close()
                assert tiers[0].stats()["leased_entries"] == 0
        finally:
            for tier in tiers:
                tier.close()


# -- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tiered", [False, True], ids=["staging", "host-tier"])
def test_a_cuda_load_copies_chunks_to_the_device_and_records_an_event_per_layer(
    toy: Toy, ckpt: Path, tiered: bool
) -> None:
    tier = FakeHostTier() if tiered else None
    with Loader(tier, chunk_bytes=4 * KIB) as loader:
        for expected in ("disk", "host") if tiered else ("disk", "disk"):
            loaded = loader.load(ckpt, device="cuda")
            assert loaded.source == expected
            assert all(t.device.type == "cuda" for t in loaded.tensors.values())
            assert_same(toy, loaded.tensors)
            assert set(loaded.cuda_events) == set(loaded.layer_ready)
            loaded.close()
