"""What only the Z-Image family has, and its workflows against ``ZImagePipeline`` /
``ZImageControlNetPipeline`` one by one: every workflow (base and Turbo, ControlNet, LoRA) run node
by node gives the pipeline's final latents and image bitwise; the text encoder is ``encode_prompt``;
the scheduler step takes a tail of the schedule (an image-to-image loop); the Turbo scheduler
ignores the resolution shift; the ControlNet node shares the transformer's modules and needs a
ControlNet pipeline folder; the tokenizer and the builder.

What every family shares (the harness cases, warm LoRA switching, mid-forward fetches,
signatures, entry points) is ``test_each_family.py``; the harness is
:class:`tests.unit.model_families.ZImage`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from libs.models import zimage, zimage_controlnet, zimage_workflows
from libs.models.tiny_zimage import MANIFEST, build, components, is_built, qwen_tokenizer
from tests.unit.model_families import NEGATIVE, PROMPT, ZImage, harness

# The thread count changes the bits: pipelines and nodes alike run on one thread.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The text-to-image workflows (img2img and inpainting: tests/unit/test_img2img_inpaint.py).
WORKFLOWS = [w.name for w in zimage_workflows.workflows() if "image" not in w.params]


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> ZImage:
    return harness("zimage", tmp_path_factory)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def paths(h: ZImage) -> dict[str, Path]:
    return h.paths


@pytest.mark.parametrize("workflow", WORKFLOWS)
def test_each_workflow_gives_the_pipelines_latents_and_image_bitwise(h: ZImage, workflow: str) -> None:
    params = h.request(workflow, seed=21, height=96, width=64)

    got = h.run(h.runner, workflow, params)
    expected = h.reference(workflow, params)

    assert got.image.shape == (96, 64, 3) and np.unique(got.image).size > 10
    assert got.latents is not None and expected.latents is not None
    assert torch.equal(got.latents, expected.latents)
    assert np.array_equal(got.image, expected.image)


def test_the_turbo_workflows_default_to_the_pipeline_examples_steps_and_no_guidance() -> None:
    from diffusers.pipelines.z_image import pipeline_z_image

    example = pipeline_z_image.EXAMPLE_DOC_STRING
    assert "Z-Image-Turbo" in example and "num_inference_steps=8" in example
    assert "guidance_scale=0.0" in example
    call = inspect.signature(pipeline_z_image.ZImagePipeline.__call__).parameters
    for spec in zimage_workflows.workflows():
        steps, guidance = spec.params["num_inference_steps"].default, spec.params["guidance_scale"].default
        if "turbo" in spec.name:
            assert (steps, guidance) == (8, 0.0), spec.name
        else:
            assert guidance == call["guidance_scale"].default == 5.0, spec.name
        assert spec.params["cfg_truncation"].default == call["cfg_truncation"].default
        assert spec.params["cfg_normalization"].default == float(call["cfg_normalization"].default)


def test_the_lora_and_the_controlnet_change_the_turbo_image_and_lora_off_is_the_base(h: ZImage) -> None:
    base = h.run(h.runner, "tiny-zimage-turbo", h.request("tiny-zimage-turbo"))
    styled = h.run(h.runner, "tiny-zimage-turbo-lora", h.request("tiny-zimage-turbo-lora"))
    plain = h.run(h.runner, "tiny-zimage-turbo-lora", h.request("tiny-zimage-turbo-lora", lora=""))
    controlled = h.run(h.runner, "tiny-zimage-turbo-controlnet", h.request("tiny-zimage-turbo-controlnet"))

    assert not np.array_equal(base.image, styled.image)
    assert not np.array_equal(base.image, controlled.image)
    assert plain.same(base)


def test_the_text_encoder_is_encode_prompt_and_skips_the_negative_prompt_without_guidance(
    h: ZImage, paths: dict[str, Path]
) -> None:
    node = zimage.ZImageTextEncoder()
    parts = node.load_model(str(paths["tiny-zimage"]), "cpu")
    pipe = h.pipeline("tiny-zimage", False)

    guided = node.execute(
        parts, prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=4.0, max_sequence_length=64
    )
    unguided = node.execute(
        parts, prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=0.0, max_sequence_length=64
    )
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt(
            PROMPT, do_classifier_free_guidance=True, negative_prompt=NEGATIVE, max_sequence_length=64
        )

    assert guided["prompt_embeds"].shape == (64, 16), "the prompt fills max_sequence_length"
    assert torch.equal(guided["prompt_embeds"], embeds[0])
    assert torch.equal(guided["negative_prompt_embeds"], negative[0])
    assert guided["negative_prompt_embeds"].shape[0] < 64, "the padding is dropped"
    assert torch.equal(unguided["prompt_embeds"], embeds[0])
    assert unguided["negative_prompt_embeds"].shape == (0, 16)


def test_the_scheduler_step_runs_a_tail_of_the_schedule_as_the_pipelines_stateful_scheduler(
    paths: dict[str, Path],
) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = str(paths["tiny-zimage"])
    prepare, step = zimage.ZImagePrepareLatents(), zimage.ZImageSchedulerStep()
    init = prepare.execute(
        prepare.load_model(model, "cpu"), seed=1, height=64, width=96, num_inference_steps=6
    )
    parts = step.load_model(model, "cpu")
    # What an image-to-image pipeline's get_timesteps does with strength 0.5: the last 3 steps.
    reference = FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler")
    zimage._set_timesteps(reference, 6, init["latents"].shape, "cpu")
    reference.set_begin_index(3)
    tail = reference.timesteps[3:]
    assert torch.equal(reference.timesteps, init["timesteps"])
    noise = torch.randn((3, *init["latents"].shape), generator=torch.Generator().manual_seed(0))

    ours = theirs = init["latents"]
    for i, t in enumerate(tail):
        ours = step.execute(
            parts, noise_pred=noise[i], latents=ours, timesteps=tail, step=i, num_inference_steps=6
        )["latents"]
        theirs = reference.step(noise[i], t, theirs, return_dict=False)[0]
        assert torch.equal(ours, theirs), i
    with pytest.raises(ValueError, match="outside"):
        step.execute(parts, noise_pred=noise[0], latents=ours, timesteps=tail, step=3, num_inference_steps=6)


def test_the_base_schedule_shifts_with_the_resolution_and_the_turbo_one_does_not(
    paths: dict[str, Path],
) -> None:
    def timesteps(model: str, height: int, width: int) -> torch.Tensor:
        node = zimage.ZImagePrepareLatents()
        parts = node.load_model(str(paths[model]), "cpu")
        return node.execute(parts, seed=0, height=height, width=width, num_inference_steps=8)["timesteps"]

    assert not torch.equal(timesteps("tiny-zimage", 64, 64), timesteps("tiny-zimage", 256, 256))
    assert torch.equal(timesteps("tiny-zimage-turbo", 64, 64), timesteps("tiny-zimage-turbo", 256, 256))
    with pytest.raises(ValueError, match="divisible by 16"):
        timesteps("tiny-zimage", 64, 72)


def test_the_controlnet_shares_the_transformers_modules_and_needs_a_controlnet_pipeline_folder(
    paths: dict[str, Path],
) -> None:
    node = zimage_controlnet.ZImageControlNet()
    parts = node.load_model(str(paths["tiny-zimage-controlnet"]), "cpu")

    assert parts["controlnet"].noise_refiner is parts["transformer"].noise_refiner
    assert parts["controlnet"].cap_embedder is parts["transformer"].cap_embedder
    assert parts["controlnet"].config.control_in_dim == 33  # the zero-padded control latents
    for cls in (zimage_controlnet.ZImageControlNet, zimage_controlnet.ZImageControlEncode):
        with pytest.raises(ValueError, match="ZImageControlNetPipeline folder"):
            cls().load_model(str(paths["tiny-zimage"]), "cpu")


def test_the_transformer_refuses_block_samples_without_their_layer_places(paths: dict[str, Path]) -> None:
    node = zimage.ZImageTransformer()
    parts = node.load_model(str(paths["tiny-zimage"]), "cpu")
    inputs: dict[str, Any] = dict(
        latents=torch.zeros(1, 16, 8, 8),
        timesteps=torch.tensor([1000.0]),
        step=0,
        guidance_scale=0.0,
        cfg_normalization=0.0,
        cfg_truncation=1.0,
        prompt_embeds=torch.zeros(4, 16),
        negative_prompt_embeds=torch.zeros(0, 16),
    )

    with pytest.raises(ValueError, match="bound together"):
        node.execute(parts, **inputs, controlnet_block_samples=[torch.zeros(1)])


def test_the_qwen_tokenizer_reloads_with_the_same_ids_and_chat_template(paths: dict[str, Path]) -> None:
    from transformers import Qwen2Tokenizer

    built = qwen_tokenizer()
    loaded = Qwen2Tokenizer.from_pretrained(paths["tiny-zimage"], subfolder="tokenizer")
    messages = [{"role": "user", "content": "line one\nline two ~é~ 123"}]
    text = loaded.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )

    assert text == "<|im_start|>user\nline one\nline two ~é~ 123<|im_end|>\n<|im_start|>assistant\n"
    assert built(text).input_ids == loaded(text).input_ids
    assert loaded(text).input_ids[0] == loaded.convert_tokens_to_ids("<|im_start|>")
    assert loaded.pad_token_id == 0


def test_build_is_idempotent_seeded_and_writes_the_manifests_last(h: ZImage, paths: dict[str, Path]) -> None:
    root = h.root
    manifest = root / "tiny-zimage" / MANIFEST
    before = manifest.stat().st_mtime_ns
    lora_before = paths["tiny-zimage-style"].stat().st_mtime_ns

    assert build(root) == paths
    assert is_built(root) and not is_built(root, seed=1)
    assert manifest.stat().st_mtime_ns == before
    assert paths["tiny-zimage-style"].stat().st_mtime_ns == lora_before
    assert paths["tiny-zimage-style"] == root / "loras" / "tiny-zimage-style.safetensors"
    assert (root / "tiny-zimage-turbo-controlnet" / "controlnet" / "config.json").is_file()
    first, second = components(0)["transformer"].state_dict(), components(0)["transformer"].state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first), "pad tokens included"
