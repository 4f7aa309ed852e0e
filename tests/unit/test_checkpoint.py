"""Converted checkpoints of real components: every component type the catalog loads converts and
loads back (``load_component``) bitwise as ``from_pretrained`` gives it, ties and non-persistent
buffers included; layers follow the forward; a missing, stale, truncated or corrupt checkpoint is
converted again, never handed out; the CLI converts and verifies pipeline folders.

The family identity tests (``test_*_family.py``) check the same path end to end: every workflow,
now loading through ``load_component``, still equals its diffusers pipeline bitwise.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.dataplane import checkpoint as ck
from libs.dataplane.errors import CheckpointMismatch, CorruptCheckpoint
from libs.dataplane.loader import Loader
from libs.models import common, families
from libs.models.common import load_component, loaded_checkpoint
from tests.unit.test_loader import FakeHostTier, Toy, every_tensor, write

# Every component with weights that the catalog's ModelFns load: (model folder, subfolder).
COMPONENTS = [
    ("tiny-flux", "text_encoder"),
    ("tiny-flux", "text_encoder_2"),
    ("tiny-flux", "transformer"),
    ("tiny-flux", "vae"),
    ("tiny-flux-controlnet", None),
    ("tiny-sd15", "text_encoder"),
    ("tiny-sd15", "unet"),
    ("tiny-sd15", "vae"),
    ("tiny-sd15-controlnet", None),
    ("tiny-sd3", "text_encoder"),
    ("tiny-sd3", "text_encoder_2"),
    ("tiny-sd3", "text_encoder_3"),
    ("tiny-sd3", "transformer"),
    ("tiny-sd3", "vae"),
    ("tiny-sd3-controlnet", None),
    ("tiny-sana", "text_encoder"),
    ("tiny-sana", "transformer"),
    ("tiny-sana", "vae"),
    ("tiny-sana-controlnet", "controlnet"),
    ("tiny-zimage", "text_encoder"),
    ("tiny-zimage", "transformer"),
    ("tiny-zimage", "vae"),
    ("tiny-zimage-controlnet", "controlnet"),
    ("tiny-flux2-klein", "text_encoder"),
    ("tiny-flux2-klein", "transformer"),
    ("tiny-flux2-klein", "vae"),
    ("tiny-qwenimage", "text_encoder"),
    ("tiny-qwenimage", "transformer"),
    ("tiny-qwenimage", "vae"),
    ("tiny-qwenimage-controlnet", "controlnet"),
]
# What a family's node loads a component under (the Qwen-Image transformer's RoPE tables are plain
# tensors, computed on the CPU: libs.models.qwenimage_loading).
LOAD_CONTEXTS = {
    ("tiny-qwenimage", "transformer"): "libs.models.qwenimage_loading:rope_tables_on_cpu",
    ("tiny-qwenimage-controlnet", "controlnet"): "libs.models.qwenimage_loading:rope_tables_on_cpu",
}


def _id(c: tuple[str, str | None]) -> str:
    return f"{c[0]}/{c[1]}" if c[1] else c[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt-models")
    families.build(root)
    return root


@pytest.fixture(scope="module")
def loader() -> Any:
    with Loader(disk_threads=2) as made:
        yield made


def reference(cls: type, model_path: Path, sub: str | None, **kwargs: Any) -> Any:
    return (
        cls.from_pretrained(str(model_path), subfolder=sub, **kwargs)
        if sub
        else cls.from_pretrained(str(model_path), **kwargs)
    )


def assert_same_model(ours: Any, ref: Any) -> None:
    """Every parameter and buffer (every name, persistent or not) bitwise equal, same dtype and
    requires_grad; tensors shared between names in ``ref`` shared in ``ours``; same configuration."""
    assert type(ours) is type(ref) and not ours.training
    a, b = every_tensor(ours), every_tensor(ref)
    assert set(a) == set(b)
    for name, t in b.items():
        got = a[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert got.requires_grad == t.requires_grad, name
        assert torch.equal(got.detach().cpu(), t.detach().cpu()), name
        assert not got.is_meta, name
        if got.device.type == "cpu" and t.device.type == "cpu" and t.numel():
            # CPU kernels choose their vector loops by the address's alignment: keep it
            assert got.data_ptr() % 64 == t.data_ptr() % 64, name
    groups: dict[int, list[str]] = {}
    for name, t in b.items():
        groups.setdefault(id(t), []).append(name)
    for names in groups.values():
        assert len({id(a[n]) for n in names}) == 1, f"tie lost: {names}"
    if hasattr(ref.config, "_attn_implementation"):  # transformers: configured as from_pretrained does
        assert ours.config._attn_implementation == ref.config._attn_implementation
        assert ours.config.dtype == ref.config.dtype
        assert ours.config.to_dict() == ref.config.to_dict()
    else:
        assert dict(ours.config) == dict(ref.config)


def copy_model(models: Path, name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(models / name, out, ignore=shutil.ignore_patterns(ck.CKPT_DIRNAME))
    return out


# -- round trip ------------------------------------------------------------------------------------


def test_the_round_trip_covers_every_component_type_the_catalog_builds(models: Path) -> None:
    found = {
        (d.name if d != folder else "", ck.class_id(ck.resolve_class(d)))
        for folder in models.iterdir()
        if folder.is_dir() and folder.name != "loras"
        for d in ck.component_dirs(folder)
    }
    covered = {
        (sub or "", ck.class_id(ck.resolve_class(models / name / sub if sub else models / name)))
        for name, sub in COMPONENTS
    }
    assert found == covered


@pytest.mark.parametrize("component", COMPONENTS, ids=_id)
def test_every_catalog_component_loads_bitwise_as_from_pretrained_gives_it(
    models: Path, loader: Loader, component: tuple[str, str | None]
) -> None:
    name, sub = component
    path = models / name
    cls = ck.resolve_class(path / sub if sub else path)
    context: Any = contextlib.nullcontext()
    if component in LOAD_CONTEXTS:
        module, _, fn = LOAD_CONTEXTS[component].partition(":")
        context = getattr(importlib.import_module(module), fn)()
    with context:
        ours = load_component(cls, str(path), sub, "cpu", loader)
    assert_same_model(ours, reference(cls, path, sub))
    loaded = loaded_checkpoint(ours)
    assert loaded is not None and loaded.source == "disk" and loaded.done()
    assert loaded.path == ck.checkpoint_dir(path / sub if sub else path)
    assert str(loaded.path).endswith(f"{ck.CKPT_DIRNAME}/native")
    index = ck.verify(loaded.path)
    assert index.source == ck.source_of(loaded.path.parent.parent, cls)
    assert all(t.offset % {"float32": 4}.get(t.dtype, 1) == 0 for t in index.tensors)


def test_tied_weights_are_stored_once_and_bound_as_one_tensor(models: Path, loader: Loader) -> None:
    from transformers import T5EncoderModel

    t5 = load_component(T5EncoderModel, str(models / "tiny-flux"), "text_encoder_2", "cpu", loader)
    assert t5.shared.weight is t5.encoder.embed_tokens.weight
    index = loaded_checkpoint(t5).index
    alias = next(t for t in index.tensors if t.name == "encoder.embed_tokens.weight")
    assert alias.alias_of == "shared.weight"


def test_non_persistent_buffers_are_stored_and_restored(models: Path, loader: Loader) -> None:
    from transformers import CLIPTextModel

    clip = load_component(CLIPTextModel, str(models / "tiny-flux"), "text_encoder", "cpu", loader)
    names = {t.name: t for t in loaded_checkpoint(clip).index.tensors}
    position_ids = next(n for n in names if n.endswith("position_ids"))
    assert names[position_ids].kind == "buffer"
    assert position_ids not in clip.state_dict()  # not persistent, yet restored exactly
    ref = CLIPTextModel.from_pretrained(str(models / "tiny-flux"), subfolder="text_encoder")
    assert torch.equal(clip.get_buffer(position_ids), ref.get_buffer(position_ids))


def test_a_dtype_conversion_gives_what_from_pretrained_with_that_dtype_gives(
    models: Path, loader: Loader, tmp_path: Path
) -> None:
    from diffusers import AutoencoderKL
    from transformers import T5EncoderModel

    path = copy_model(models, "tiny-flux", tmp_path)
    for cls, sub, key in ((AutoencoderKL, "vae", "torch_dtype"), (T5EncoderModel, "text_encoder_2", "dtype")):
        ours = load_component(cls, str(path), sub, "cpu", loader, dtype=torch.bfloat16)
        assert_same_model(ours, reference(cls, path, sub, **{key: torch.bfloat16}))
        assert loaded_checkpoint(ours).path == path / sub / ck.CKPT_DIRNAME / "bfloat16"


# -- layout ----------------------------------------------------------------------------------------


def layer_names(models: Path, name: str, sub: str | None) -> list[str]:
    d = models / name / sub if sub else models / name
    return [layer.name for layer in ck.read_index(ck.ensure_converted(d)).layers]


def test_layers_follow_the_forward_so_a_prefix_of_the_file_is_a_prefix_of_the_model(models: Path) -> None:
    unet = layer_names(models, "tiny-sd15", "unet")
    assert unet == [
        "conv_in",
        "time_embedding",
        "down_blocks.0",
        "down_blocks.1",
        "mid_block",  # registered after up_blocks, runs before them
        "up_blocks.0",
        "up_blocks.1",
        "conv_norm_out",
        "conv_out",
    ]
    flux = layer_names(models, "tiny-flux", "transformer")
    assert (
        flux.index("x_embedder")
        < flux.index("transformer_blocks.0")
        < flux.index("single_transformer_blocks.0")
    )
    assert flux[-2:] == ["norm_out", "proj_out"]
    vae = layer_names(models, "tiny-flux", "vae")
    assert vae.index("encoder.down_blocks.1") < vae.index("encoder.mid_block") < vae.index("decoder.conv_in")
    assert vae.index("decoder.mid_block") < vae.index("decoder.up_blocks.0")
    t5 = layer_names(models, "tiny-flux", "text_encoder_2")
    assert t5 == [
        "shared",
        "encoder.embed_tokens",
        "encoder.block.0",
        "encoder.block.1",
        "encoder.final_layer_norm",
    ]
    gemma = layer_names(models, "tiny-sana", "text_encoder")
    assert gemma == ["embed_tokens", "rotary_emb", "layers.0", "norm"]
    index = ck.read_index(ck.checkpoint_dir(models / "tiny-sd15" / "unet"))
    ends = [layer.end for layer in index.layers]
    assert ends == sorted(ends) and index.layers[0].start < ck.ADDRESS_MODULUS


def test_partitions_split_at_the_size_limit_and_load_back_bitwise(models: Path, tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel

    path = copy_model(models, "tiny-flux", tmp_path)
    out = ck.convert(path / "transformer", chunk_bytes=8192, partition_bytes=64 * 1024)
    index = ck.read_index(out)
    assert len(index.partitions) > 3 and index.chunk_bytes == 8192
    assert all(p.nbytes % ck.PAGE == 0 and p.nbytes <= 64 * 1024 + ck.PAGE for p in index.partitions)
    with Loader(chunk_bytes=8192) as loader:
        ours = load_component(FluxTransformer2DModel, str(path), "transformer", "cpu", loader)
    assert ck.read_index(out) == index  # used as it is
    assert_same_model(ours, reference(FluxTransformer2DModel, path, "transformer"))


# -- missing, stale, truncated, corrupt ------------------------------------------------------------


def test_a_missing_checkpoint_is_converted_once_and_reused(models: Path, tmp_path: Path, caplog: Any) -> None:
    path = copy_model(models, "tiny-sd15", tmp_path) / "vae"
    caplog.set_level(logging.INFO, logger="libs.dataplane.checkpoint")
    out = ck.ensure_converted(path)
    first = (out / ck.INDEX_NAME).stat().st_ino
    assert ck.ensure_converted(path) == out and (out / ck.INDEX_NAME).stat().st_ino == first
    assert sum("converting" in r.getMessage() for r in caplog.records) == 1


def test_concurrent_callers_convert_once(models: Path, tmp_path: Path, caplog: Any) -> None:
    path = copy_model(models, "tiny-sd15", tmp_path) / "unet"
    caplog.set_level(logging.INFO, logger="libs.dataplane.checkpoint")
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ck.ensure_converted(path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 3 and len(set(results)) == 1
    assert sum(r.getMessage().startswith("converted ") for r in caplog.records) == 1
    assert not list((path / ck.CKPT_DIRNAME).glob(".tmp-*"))


def test_a_changed_source_is_converted_again_and_its_new_weights_are_loaded(
    models: Path, tmp_path: Path, loader: Loader, caplog: Any
) -> None:
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file, save_file

    path = copy_model(models, "tiny-sd15", tmp_path)
    load_component(AutoencoderKL, str(path), "vae", "cpu", loader)
    weights = path / "vae" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state["decoder.conv_out.bias"] += 1.0
    save_file(state, weights, metadata={"format": "pt"})
    caplog.set_level(logging.WARNING, logger="libs.dataplane.checkpoint")
    ours = load_component(AutoencoderKL, str(path), "vae", "cpu", loader)
    assert any("stale" in r.getMessage() for r in caplog.records)
    assert_same_model(ours, reference(AutoencoderKL, path, "vae"))


def test_a_truncated_partition_is_detected_and_converted_again(
    models: Path, tmp_path: Path, loader: Loader, caplog: Any
) -> None:
    from diffusers import UNet2DConditionModel

    path = copy_model(models, "tiny-sd15", tmp_path)
    first = load_component(UNet2DConditionModel, str(path), "unet", "cpu", loader)
    part = loaded_checkpoint(first).path / "part-000.bin"
    del first
    with open(part, "r+b") as f:
        f.truncate(part.stat().st_size // 2)
    assert "truncated" in (ck.problem(ck.checkpoint_dir(path / "unet")) or "")
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        loader.load(ck.checkpoint_dir(path / "unet"))
    caplog.set_level(logging.WARNING, logger="libs.dataplane.checkpoint")
    ours = load_component(UNet2DConditionModel, str(path), "unet", "cpu", loader)
    assert any("re-converting" in r.getMessage() and "truncated" in r.getMessage() for r in caplog.records)
    assert_same_model(ours, reference(UNet2DConditionModel, path, "unet"))
    ck.verify(ck.checkpoint_dir(path / "unet"))


def test_a_flipped_byte_is_caught_by_its_chunk_crc_and_converted_again(
    models: Path, tmp_path: Path, loader: Loader, caplog: Any
) -> None:
    from transformers import CLIPTextModel

    path = copy_model(models, "tiny-sd15", tmp_path)
    ckpt = ck.ensure_converted(path / "text_encoder")
    part = ckpt / "part-000.bin"
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0x10
    part.write_bytes(bytes(data))
    assert ck.problem(ckpt) is None  # sizes are right: only the CRCs can tell
    assert "CRC32" in (ck.problem(ckpt, verify_crc=True) or "")
    with pytest.raises(CorruptCheckpoint, match="CRC32"):
        ck.verify(ckpt)
    caplog.set_level(logging.WARNING)
    ours = load_component(CLIPTextModel, str(path), "text_encoder", "cpu", loader)
    messages = [r.getMessage() for r in caplog.records]
    assert any("CRC32" in m for m in messages) and any("re-converting" in m for m in messages)
    assert_same_model(ours, reference(CLIPTextModel, path, "text_encoder"))
    ck.verify(ckpt)


def test_a_component_whose_checkpoint_cannot_be_written_loads_with_from_pretrained(
    models: Path, tmp_path: Path, loader: Loader, caplog: Any
) -> None:
    from diffusers import AutoencoderKL

    path = copy_model(models, "tiny-sd15", tmp_path)
    (path / "vae" / ck.CKPT_DIRNAME).write_text("")  # stands in for a read-only model store
    caplog.set_level(logging.WARNING, logger="libs.models.common")
    ours = load_component(AutoencoderKL, str(path), "vae", "cpu", loader)
    assert loaded_checkpoint(ours) is None and any("cannot convert" in r.getMessage() for r in caplog.records)
    assert_same_model(ours, reference(AutoencoderKL, path, "vae"))


def test_a_model_that_does_not_fit_its_checkpoint_fails_loudly(tmp_path: Path) -> None:
    class Wider(Toy):
        def __init__(self) -> None:
            super().__init__()
            self.extra = torch.nn.Parameter(torch.zeros(3))

    torch.manual_seed(0)
    ckpt = write(Toy(), tmp_path / "toy")
    with Loader() as loader:
        loaded = loader.load(ckpt)
    with torch.device("meta"):
        wider = Wider()
    with pytest.raises(CheckpointMismatch) as caught:
        common._bind(wider, loaded)
    assert caught.value.names == ["extra"] and "meta" in str(caught.value)
    with torch.device("meta"):
        narrower = Toy(n=5)
    with pytest.raises(CheckpointMismatch) as caught:
        common._bind(narrower, loaded)
    assert "blocks.5.lin.weight" in caught.value.names


# -- the host tier and the ModelFn contract --------------------------------------------------------


def test_modelfns_record_their_loads_and_a_second_executor_hits_the_host_tier(
    models: Path, tmp_path: Path
) -> None:
    from libs.models.flux import FluxTransformer, FluxVaeDecode

    path = str(copy_model(models, "tiny-flux", tmp_path))
    tier = FakeHostTier()
    with Loader(tier) as first, Loader(tier) as second:
        a = FluxVaeDecode().load_model(path, "cpu", first)
        b = FluxVaeDecode().load_model(path, "cpu", second)
        t = FluxTransformer().load_model(path, "cpu", second)
    (la,), (lb,), (lt,) = a[common.LOADS], b[common.LOADS], t[common.LOADS]
    assert (la.source, lb.source, lt.source) == ("disk", "host", "disk")
    assert la.bytes_from_disk == la.nbytes and lb.bytes_from_disk == 0
    assert_same_model(b["vae"], a["vae"])
    assert FluxVaeDecode().load_model(path, "cpu")[common.LOADS][0].source == "disk"  # default loader
    key = la.key
    del a, b, la, lb
    import gc

    gc.collect()
    assert tier.closed.count(key) == 2  # released when the models are dropped


# -- CLI -------------------------------------------------------------------------------------------


def test_the_cli_converts_every_component_of_a_pipeline_folder_and_verifies_them(
    models: Path, tmp_path: Path, capsys: Any
) -> None:
    path = copy_model(models, "tiny-sd3", tmp_path)
    assert ck.main(["convert", str(path)]) == 0
    converted = sorted(p.parent.parent.name for p in path.glob(f"*/{ck.CKPT_DIRNAME}/native"))
    assert converted == ["text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"]
    assert ck.main(["convert", str(path / "vae"), "--dtype", "bfloat16"]) == 0
    assert ck.read_index(path / "vae" / ck.CKPT_DIRNAME / "bfloat16").tensors[-1].dtype == "bfloat16"
    capsys.readouterr()
    assert ck.main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.count(": ok") == 6
    part = path / "vae" / ck.CKPT_DIRNAME / "native" / "part-000.bin"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    assert ck.main(["verify", str(path / "vae")]) == 1
    assert "CORRUPT" in capsys.readouterr().out


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("component", [("tiny-flux", "text_encoder_2"), ("tiny-sd15", "unet")], ids=_id)
def test_a_component_loads_onto_cuda_bitwise_as_from_pretrained_then_to_cuda(
    models: Path, component: tuple[str, str | None]
) -> None:
    name, sub = component
    path = models / name
    cls = ck.resolve_class(path / sub if sub else path)
    with Loader() as loader:
        ours = load_component(cls, str(path), sub, "cuda", loader)
        ref = reference(cls, path, sub).to("cuda")
        assert all(t.is_cuda for t in every_tensor(ours).values())
        assert_same_model(ours, ref)
