"""The Flux ModelFns, called node by node without a runner, reproduce diffusers' FluxPipeline bitwise
(tiny random model), also when every tensor crosses as bytes; and the Flux builder's pieces.

Signatures, entry points and the scheduler step's schedule check are ``test_each_family.py``'s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from libs.models import flux
from libs.models.build_utils import clip_tokenizer, t5_tokenizer
from libs.models.tiny_flux import MANIFEST, build_flux, read_manifest, write_manifest
from tests.unit.model_families import harness

PROMPT = "A photo of a Cat holding a sign that says 'hello world', 4k!"
GUIDANCE = 3.5
MAX_SEQ = 32

ALL_FNS = (
    flux.FluxClipEncoder,
    flux.FluxT5Encoder,
    flux.FluxPrepareLatents,
    flux.FluxTransformer,
    flux.FlowMatchEulerStep,
    flux.FluxVaeDecode,
)


class Node:
    """A fresh ModelFn instance with its loaded components."""

    def __init__(self, cls: type[flux.ModelFn], model_path: str) -> None:
        self.fn = cls()
        self.components = self.fn.load_model(model_path, "cpu")

    def __call__(self, **inputs: Any) -> dict[str, Any]:
        out = self.fn.execute(self.components, **inputs)
        assert sorted(out) == sorted(self.fn.outputs)
        return out


# The thread count changes the bits: pipelines and nodes alike run on one thread.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(harness("flux", tmp_path_factory).paths["tiny-flux"])  # build_flux(..., "tiny", seed=0)


@pytest.fixture(scope="module")
def pipe(model_path: str) -> Any:
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(model_path)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def nodes(model_path: str) -> dict[str, Node]:
    return {cls.fn_name: Node(cls, model_path) for cls in ALL_FNS}


def pipeline_image(pipe: Any, height: int, width: int, steps: int, seed: int) -> torch.Tensor:
    """The monolithic pipeline's image as a uint8 [H, W, 3] tensor (threads pinned by ``one_thread``)."""
    image = pipe(
        PROMPT,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=GUIDANCE,
        generator=torch.Generator().manual_seed(seed),
        max_sequence_length=MAX_SEQ,
    ).images[0]
    return torch.from_numpy(np.array(image))


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def through_bytes(t: Any) -> Any:
    """What the data plane does to a tensor (each of a list output's): raw bytes out, a new
    tensor over the bytes in."""
    if isinstance(t, list):
        return [through_bytes(x) for x in t]
    data = bytearray(t.contiguous().numpy().tobytes())
    return torch.frombuffer(data, dtype=t.dtype).reshape(t.shape)


def run_workflow(
    nodes: dict[str, Node],
    height: int,
    width: int,
    steps: int,
    seed: int,
    transport: Callable[[torch.Tensor], torch.Tensor] = identity,
) -> torch.Tensor:
    """The Flux workflow, node after node, every tensor output passed through ``transport``."""
    state: dict[str, torch.Tensor] = {}

    def run(fn_name: str, **inputs: Any) -> None:
        state.update({k: transport(v) for k, v in nodes[fn_name](**inputs).items()})

    run("flux.clip_encoder", prompt=PROMPT)
    run("flux.t5_encoder", prompt=PROMPT, max_sequence_length=MAX_SEQ)
    run("flux.prepare_latents", seed=seed, height=height, width=width, num_inference_steps=steps)
    for step in range(steps):
        run(
            "flux.transformer",
            latents=state["latents"],
            timesteps=state["timesteps"],
            step=step,
            guidance_scale=GUIDANCE,
            prompt_embeds=state["prompt_embeds"],
            pooled_prompt_embeds=state["pooled_prompt_embeds"],
            text_ids=state["text_ids"],
            latent_image_ids=state["latent_image_ids"],
        )
        run(
            "flux.flow_match_step",
            noise_pred=state["noise_pred"],
            latents=state["latents"],
            timesteps=state["timesteps"],
            step=step,
            num_inference_steps=steps,
        )
    run("flux.vae_decode", latents=state["latents"], height=height, width=width)
    return state["image"]


CASES = [
    pytest.param(128, 128, 4, 0, id="128x128-4steps-seed0"),
    pytest.param(128, 64, 3, 7, id="128x64-3steps-seed7"),
    pytest.param(64, 96, 2, 1234, id="64x96-2steps-seed1234"),
]


@pytest.mark.parametrize(("height", "width", "steps", "seed"), CASES)
def test_the_six_modelfns_in_order_reproduce_the_pipeline_image_bitwise(
    nodes: dict[str, Node], pipe: Any, height: int, width: int, steps: int, seed: int
) -> None:
    image = run_workflow(nodes, height, width, steps, seed)
    expected = pipeline_image(pipe, height, width, steps, seed)

    assert image.dtype == torch.uint8 and image.shape == (height, width, 3)
    assert image.unique().numel() > 10, "a flat image would make the comparison meaningless"
    assert torch.equal(image, expected)


def test_the_decomposition_stays_bitwise_equal_when_every_tensor_crosses_as_bytes(
    nodes: dict[str, Node], pipe: Any
) -> None:
    image = run_workflow(nodes, 128, 64, 3, 7, transport=through_bytes)

    assert torch.equal(image, pipeline_image(pipe, 128, 64, 3, 7))


def test_the_same_node_with_the_same_inputs_gives_identical_bytes(nodes: dict[str, Node]) -> None:
    prepare, transformer = nodes["flux.prepare_latents"], nodes["flux.transformer"]
    first = prepare(seed=3, height=128, width=128, num_inference_steps=4)
    again = prepare(seed=3, height=128, width=128, num_inference_steps=4)
    text = nodes["flux.t5_encoder"](prompt=PROMPT, max_sequence_length=MAX_SEQ)
    pooled = nodes["flux.clip_encoder"](prompt=PROMPT)
    step_inputs = dict(
        latents=first["latents"],
        timesteps=first["timesteps"],
        step=1,
        guidance_scale=GUIDANCE,
        latent_image_ids=first["latent_image_ids"],
        **text,
        **pooled,
    )

    for name in first:
        if name == "cache_state":  # the step cache's first state: none (libs.models.stepcache)
            assert first[name] == again[name] == []
            continue
        assert first[name].numpy().tobytes() == again[name].numpy().tobytes()
    noise_a = transformer(**step_inputs)["noise_pred"]
    noise_b = transformer(**step_inputs)["noise_pred"]
    assert noise_a.numpy().tobytes() == noise_b.numpy().tobytes()


def test_different_seeds_give_different_latents(nodes: dict[str, Node]) -> None:
    prepare = nodes["flux.prepare_latents"]
    a = prepare(seed=0, height=64, width=64, num_inference_steps=2)
    b = prepare(seed=1, height=64, width=64, num_inference_steps=2)

    assert not torch.equal(a["latents"], b["latents"])
    assert torch.equal(a["latent_image_ids"], b["latent_image_ids"])
    assert torch.equal(a["timesteps"], b["timesteps"])


def test_the_text_encoders_match_encode_prompt_and_text_ids_take_the_clip_dtype(
    nodes: dict[str, Node], pipe: Any
) -> None:
    out = nodes["flux.t5_encoder"](prompt=PROMPT, max_sequence_length=MAX_SEQ)
    pooled = nodes["flux.clip_encoder"](prompt=PROMPT)["pooled_prompt_embeds"]
    with torch.no_grad():  # as in FluxPipeline.__call__; grad mode changes the bits
        prompt_embeds, pooled_prompt_embeds, text_ids = pipe.encode_prompt(
            PROMPT, prompt_2=None, max_sequence_length=MAX_SEQ
        )

    assert out["text_ids"].dtype == pipe.text_encoder.dtype == text_ids.dtype
    assert torch.equal(out["text_ids"], text_ids)
    assert out["prompt_embeds"].shape == (1, MAX_SEQ, 32)
    assert torch.equal(out["prompt_embeds"], prompt_embeds)
    assert torch.equal(pooled, pooled_prompt_embeds)


def test_the_tokenizers_reload_from_the_saved_folder_with_identical_ids(model_path: str) -> None:
    from transformers import CLIPTokenizer, T5TokenizerFast

    prompts = [PROMPT, "a cat", "UPPER lower 123 ~unknown~ é"]
    for subfolder, built, cls in (
        ("tokenizer", clip_tokenizer(), CLIPTokenizer),
        ("tokenizer_2", t5_tokenizer(), T5TokenizerFast),
    ):
        assert (Path(model_path) / subfolder / "tokenizer.json").is_file()
        loaded = cls.from_pretrained(model_path, subfolder=subfolder)
        for prompt in prompts:
            assert loaded(prompt).input_ids == built(prompt).input_ids


def test_build_flux_is_idempotent_and_the_folder_loads_as_a_flux_pipeline(model_path: str) -> None:
    from diffusers import FluxPipeline

    manifest = Path(model_path) / MANIFEST
    before = manifest.stat().st_mtime_ns

    assert build_flux(model_path, preset="tiny", seed=0) == Path(model_path)
    assert manifest.stat().st_mtime_ns == before
    assert read_manifest(model_path) == {"preset": "tiny", "seed": 0, "family": "flux"}
    pipeline = FluxPipeline.from_pretrained(model_path)
    assert pipeline.transformer.config.in_channels == 16


def test_build_flux_rebuilds_a_folder_whose_manifest_does_not_match(tmp_path: Path) -> None:
    out = tmp_path / "tiny-flux"
    out.mkdir()
    write_manifest(out, preset="tiny", seed=1)
    (out / "stale.txt").write_text("left by an older build")

    build_flux(out, preset="tiny", seed=0)

    assert read_manifest(out) == {"preset": "tiny", "seed": 0, "family": "flux"}
    assert not (out / "stale.txt").exists()
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-flux"], "the temporary build folder is gone"
