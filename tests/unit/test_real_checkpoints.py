"""Real checkpoints as a box's operator has them: a models volume of many pipelines converted by the
init job (a folder that fails named, the rest converted, idempotently), per-family dtypes with
T2I_EXECUTOR_DTYPES over them, Hub ids resolved offline from the Hugging Face cache layout into the
converter, loader and layer table (never ``from_pretrained``), sharded safetensors, the host tier's
default size, and the CUDA loads' pinned staging (``gpu``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import libs.dataplane.checkpoint as ck
from libs.dataplane.loader import Loader
from libs.models import convert as model_init
from libs.models.build_utils import save_in_hub_cache
from libs.models.families import FAMILIES, device_dtype, family_of_class
from libs.models.flux import FluxTransformer
from libs.models.sd import SdUnet
from libs.models.sd_workflows import sd_workflow
from libs.workflow.local import LocalRunner
from libs.workflow.paths import resolve_model_path
from services.executor.memory import HOST_TIER_FRACTION, default_host_tier_mb, memory_bytes
from services.executor.runtime import ModelCache, default_dtype, parse_dtypes
from tests.unit.model_families import FluxPipes, harness, sd_pipeline_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def sd(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return harness("sd", tmp_path_factory)


@pytest.fixture
def flux(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return harness("flux", tmp_path_factory)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(ck.CKPT_DIRNAME))
    return dst


def index_mtimes(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob(f"{ck.CKPT_DIRNAME}/*/{ck.INDEX_NAME}")}


# -- the init job ----------------------------------------------------------------------------------


def test_the_init_job_converts_every_model_of_a_volume_and_names_the_folder_that_fails(
    sd: Any, tmp_path: Path, capsys: Any
) -> None:
    volume = tmp_path / "models"
    copy(sd.root / "tiny-sd15", volume / "tiny-sd15")  # a pipeline
    copy(sd.root / "tiny-sd15-controlnet", volume / "nets" / "canny")  # a component, one level down
    broken = volume / "broken"  # a config naming no class diffusers has, with "weights"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"_class_name": "NoSuchModel"}))
    (broken / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")

    assert [p.relative_to(volume).as_posix() for p in ck.model_folders(volume)] == [
        "broken", "nets/canny", "tiny-sd15",
    ]  # fmt: skip
    assert model_init.main([str(volume)]) == 1  # a failure is an error ...
    out = capsys.readouterr().out
    assert f"{broken}: FAILED" in out and "converted 2 folders, 1 failed" in out
    # ... that stopped nothing: every component of the other two is converted.
    converted = sorted(
        p.parent.parent.relative_to(volume).as_posix() for p in volume.rglob(f"{ck.CKPT_DIRNAME}/native")
    )
    assert converted == [
        "nets/canny", "tiny-sd15/text_encoder", "tiny-sd15/unet", "tiny-sd15/vae",
    ]  # fmt: skip
    before = index_mtimes(volume)
    assert model_init.main([str(volume), "--keep-going"]) == 0  # the init job's way: serve the rest
    assert index_mtimes(volume) == before  # idempotent: nothing converted twice
    assert model_init.main([str(volume), "--keep-going", "--force"]) == 0
    assert all(index_mtimes(volume)[k] != v for k, v in before.items())
    capsys.readouterr()
    assert model_init.main([str(tmp_path / "empty-volume")]) == 1  # nothing anywhere: an error
    assert "nothing to convert" in capsys.readouterr().out
    (tmp_path / "empty-hub").mkdir()  # a fresh box's Hub cache beside a volume: said, not a failure
    assert model_init.main([str(volume), str(tmp_path / "empty-hub"), "--keep-going"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'empty-hub'}: nothing to convert" in out and "2 folders, 1 failed" in out


def test_the_init_job_converts_each_model_at_the_dtype_its_executors_load_it_at(
    sd: Any, tmp_path: Path
) -> None:
    volume = tmp_path / "models"
    copy(sd.root / "tiny-sd15", volume / "tiny-sd15")
    copy(sd.root / "tiny-sd15-controlnet", volume / "canny")
    pick = model_init.dtype_for("cuda", {}, [volume])
    assert pick(volume / "tiny-sd15") == "float16" and pick(volume / "canny") == "float16"
    assert model_init.dtype_for("cpu", {}, [volume])(volume / "tiny-sd15") is None  # as saved
    overrides = parse_dtypes("canny=bfloat16,*=float32")
    assert model_init.dtype_for("cuda", overrides, [volume])(volume / "canny") == "bfloat16"
    assert model_init.dtype_for("cuda", overrides, [volume])(volume / "tiny-sd15") == "float32"

    assert model_init.main([str(volume), "--device", "cuda", "--dtypes", "canny=bfloat16"]) == 0
    unet = ck.read_index(ck.checkpoint_dir(volume / "tiny-sd15" / "unet", "float16"))
    assert {t.dtype for t in unet.tensors if t.kind == "parameter"} == {"float16"}
    net = ck.read_index(ck.checkpoint_dir(volume / "canny", "bfloat16"))
    assert {t.dtype for t in net.tensors if t.kind == "parameter"} == {"bfloat16"}


# -- dtypes ----------------------------------------------------------------------------------------


def test_each_family_runs_on_cuda_at_the_dtype_its_pipeline_is_run_at_and_the_cpu_as_saved() -> None:
    assert {f: device_dtype(FAMILIES[f], "cuda:3") for f in FAMILIES} == {
        "flux": "bfloat16", "sd": "float16", "sd3": "bfloat16", "sana": "bfloat16",
        "flux2": "bfloat16",
        "zimage": "bfloat16",
        "qwenimage": "bfloat16",
    }  # fmt: skip
    assert {device_dtype(FAMILIES[f], "cpu") for f in FAMILIES} == {None}
    assert default_dtype(FluxTransformer("m"), "cuda") == "bfloat16"
    assert default_dtype(SdUnet("m"), "cuda:0") == "float16" and default_dtype(SdUnet("m"), "cpu") is None
    classes = {
        "FluxPipeline": "flux", "FluxControlNetModel": "flux", "StableDiffusionPipeline": "sd",
        "StableDiffusion3Pipeline": "sd3", "SD3ControlNetModel": "sd3", "ControlNetModel": "sd",
        "SanaPipeline": "sana", "WanPipeline": None,
        "Flux2KleinPipeline": "flux2", "Flux2Transformer2DModel": "flux2",
        "ZImagePipeline": "zimage", "ZImageControlNetModel": "zimage",
        "QwenImagePipeline": "qwenimage", "QwenImageEditPipeline": "qwenimage",
    }  # fmt: skip
    assert {c: getattr(family_of_class(c), "name", None) for c in classes} == classes


def test_a_workflow_at_bf16_equals_its_pipeline_loaded_at_bf16_bitwise(sd: Any, flux: Any) -> None:
    """Noise and ids whose dtype the pipeline takes from a component's (the text encoder's) follow
    the dtype the executor loads at, not the one saved in the component's config."""
    from diffusers import FluxPipeline, StableDiffusionPipeline

    with Loader() as loader:
        for h, reference in (
            (sd, lambda params: sd_pipeline_image(sd.root, params, pipe=bf16(StableDiffusionPipeline, sd.root / "tiny-sd15"))),
            (flux, lambda params: flux_bf16(flux, FluxPipeline, params)),
        ):  # fmt: skip
            cache = ModelCache(h.root, "cpu", loader, parse_dtypes(f"{h.base}=bfloat16"))
            runner = LocalRunner(h.root, classes=h.classes(), models=cache)
            params = h.request(h.base)
            got = h.run(runner, h.base, params).image
            assert np.unique(got).size > 10
            assert np.array_equal(got, reference(params)), h.family
            weights = cache.components(f"{h.family}.{'unet' if h.family == 'sd' else 'transformer'}", h.base)[
                0
            ]
            denoiser = weights["unet" if h.family == "sd" else "transformer"]
            assert {p.dtype for p in denoiser.parameters()} == {torch.bfloat16}


def bf16(cls: type, path: Path) -> Any:
    pipe = cls.from_pretrained(path, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux_bf16(h: Any, cls: type, params: dict[str, Any]) -> np.ndarray:
    pipes = FluxPipes(h.paths)
    pipes._pipes[(h.base, False, False)] = bf16(cls, h.paths[h.base])
    return pipes.image(h.base, params).image


# -- Hub ids ---------------------------------------------------------------------------------------


def test_a_hub_id_resolves_offline_to_its_cached_snapshot_and_loads_through_the_memory_system(
    sd: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hf" / "hub"
    snapshot = save_in_hub_cache(sd.root / "tiny-sd15", "acme/tiny-sd15", hub)
    assert (hub / "models--acme--tiny-sd15" / "refs" / "main").read_text() == snapshot.name
    assert (snapshot / "unet" / "config.json").is_symlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("T2I_CHECKPOINT_CACHE", str(tmp_path / "ckpt-cache"))
    volume = tmp_path / "models"  # the executors' model root: the Hub model is not in it
    volume.mkdir()
    assert resolve_model_path("acme/tiny-sd15", volume) == str(snapshot)
    assert resolve_model_path(f"acme/tiny-sd15@{snapshot.name}", volume) == str(snapshot)
    assert resolve_model_path("acme/not-cached", volume) == "acme/not-cached"

    spec = sd_workflow("hub-sd15", "acme/tiny-sd15", sizes=["64x64"], steps=3)
    params = sd.request("tiny-sd15")
    with Loader() as loader:
        cache = ModelCache(volume, "cpu", loader)
        runner = LocalRunner(volume, classes=sd.classes(), models=cache)
        out = runner.run(spec, params)
    expected = sd_pipeline_image(sd.root, params, pipe=sd.pipeline(False, False))
    assert np.array_equal(out["image"].numpy(), expected)
    # Through the converter and the layer table, like a folder: every weighted model is virtualised.
    unet = next(vm for key, vm in cache.weights.models.items() if getattr(key, "fn", "") == "sd.unet")
    assert len(unet.slots) > 3
    # Converted into the checkpoint cache, named after the repository and commit; the Hub cache
    # itself is left as the hub client wrote it.
    converted = tmp_path / "ckpt-cache" / "models--acme--tiny-sd15" / snapshot.name / "unet" / ck.CKPT_DIRNAME
    assert (converted / "native" / ck.INDEX_NAME).is_file()
    assert not list(hub.rglob(ck.CKPT_DIRNAME))


def test_the_init_job_converts_a_hub_cache_into_the_checkpoint_cache(
    sd: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hub"
    snapshot = save_in_hub_cache(sd.root / "tiny-sd15-controlnet", "acme/canny", hub)
    monkeypatch.setenv("T2I_CHECKPOINT_CACHE", str(tmp_path / "cache"))
    assert model_init.dtype_for("cuda", parse_dtypes("acme/canny=bfloat16"), [hub])(snapshot) == "bfloat16"
    assert model_init.main([str(hub), "--device", "cuda", "--dtypes", "acme/canny=bfloat16"]) == 0
    ckpt = ck.checkpoint_dir(snapshot, "bfloat16")
    assert ckpt == tmp_path / "cache" / "models--acme--canny" / snapshot.name / ck.CKPT_DIRNAME / "bfloat16"
    assert ck.read_index(ckpt).tensors[0].dtype == "bfloat16"
    assert not list(hub.rglob(ck.CKPT_DIRNAME))


# -- sharded checkpoints ---------------------------------------------------------------------------


def test_a_sharded_checkpoint_converts_and_loads_bitwise_as_from_pretrained(sd: Any, tmp_path: Path) -> None:
    from diffusers import UNet2DConditionModel

    from libs.models.common import load_component

    ref = UNet2DConditionModel.from_pretrained(sd.root / "tiny-sd15" / "unet")
    sharded = tmp_path / "unet"
    ref.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 3 and (sharded / "diffusion_pytorch_model.safetensors.index.json").is_file()
    with Loader() as loader:
        ours = load_component(UNet2DConditionModel, str(sharded), loader=loader)
    index = ck.read_index(ck.checkpoint_dir(sharded))
    assert {f.name for f in index.source.files} >= set(shards)  # every shard in the fingerprint
    theirs = UNet2DConditionModel.from_pretrained(sharded)
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


# -- the host tier's default -----------------------------------------------------------------------


def test_the_host_tier_defaults_to_a_fraction_of_the_smaller_of_memory_and_its_filesystem(
    tmp_path: Path,
) -> None:
    import os

    st = os.statvfs(tmp_path)
    expected = int(HOST_TIER_FRACTION * min(memory_bytes(), st.f_frsize * st.f_blocks)) >> 20
    assert default_host_tier_mb(str(tmp_path)) == expected > 0
    assert memory_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_host_tier_mb(str(tmp_path / "missing")) == 0


# -- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_first_loads_and_suffix_reloads_on_cuda_copy_from_pinned_host_memory(sd: Any) -> None:
    from libs.dataplane.loader import staging

    pinned: list[int] = []
    real_pin = staging.pin_host

    def recording(addr: int, nbytes: int, read_only: bool = False) -> int:
        got = real_pin(addr, nbytes, read_only)
        pinned.append(got)
        return got

    import services.executor.weights as weights

    weights.pin_host = recording  # the real pinning, recorded
    try:
        with Loader() as loader:
            cache = ModelCache(sd.root, "cuda", loader)
            comps, _ = cache.components("sd.unet", "tiny-sd15")
            first = len(pinned)
            assert first >= 1 and all(pinned)
            cache.trim("sd.unet", "tiny-sd15", 2)
            hold = cache.acquire("sd.unet", "tiny-sd15")
            cache.release(hold)
            assert len(pinned) > first and all(pinned)  # the suffix reload pinned its source too
            ref = type(comps["unet"]).from_pretrained(sd.root / "tiny-sd15" / "unet").to("cuda")
            for (name, a), (_, b) in zip(
                comps["unet"].state_dict().items(), ref.state_dict().items(), strict=True
            ):
                assert torch.equal(a, b), name
    finally:
        weights.pin_host = real_pin
