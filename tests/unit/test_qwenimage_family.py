"""What only the Qwen-Image family has: every workflow's latents and image against
``QwenImagePipeline`` / ``QwenImageEditPipeline`` (parametrised here with sizes the pipelines floor,
LoRA scales and edits of differently shaped pictures), the Qwen2.5-VL encoders against
``encode_prompt``, the edit's resize rule and image latents, the RoPE tables ``load_component``
must recompute, the byte-level tokenizer, and the builder.

What every family shares (warm LoRA switching, signatures, entry points, the scheduler step's
schedule check) is ``test_each_family.py``; the harness is :class:`tests.unit.model_families.QwenImage`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from libs.models import qwenimage, qwenimage_img2img
from libs.models.tiny_qwenimage import MANIFEST, build, is_built, qwen_tokenizer
from tests.unit.model_families import PROMPT, SECOND, THIRD, QwenImage, harness

# The thread count changes the bits: pipelines and nodes alike run on one thread.
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> QwenImage:
    return harness("qwenimage", tmp_path_factory)  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("workflow", "changes"),
    [
        pytest.param("tiny-qwenimage", {}, id="plain-true-cfg"),
        pytest.param("tiny-qwenimage", dict(true_cfg_scale=1.0, seed=2), id="plain-no-cfg"),
        pytest.param("tiny-qwenimage", dict(height=72, width=40, seed=5), id="plain-72x40-floored-to-64x32"),
        pytest.param(
            "tiny-qwenimage",
            dict(num_inference_steps=2, prompt="", max_sequence_length=4),
            id="plain-2-steps-empty-prompt",
        ),
        pytest.param("tiny-qwenimage-lora", dict(lora_scale=0.8), id="lora-0.8"),
        pytest.param("tiny-qwenimage-lora", dict(lora_scale=-1.5, true_cfg_scale=2.5), id="lora-negative"),
        pytest.param("tiny-qwenimage-lora", dict(lora=""), id="lora-none"),
        pytest.param("tiny-qwenimage-controlnet", {}, id="controlnet-true-cfg"),
        pytest.param(
            "tiny-qwenimage-controlnet",
            dict(control_scale=0.0, seed=3),
            id="controlnet-scale-0-still-draws-first",
        ),
        pytest.param(
            "tiny-qwenimage-controlnet",
            dict(control_scale=2.5, true_cfg_scale=1.0, height=72, width=40),
            id="controlnet-2.5-no-cfg-floored",
        ),
        pytest.param("tiny-qwenimage-controlnet-lora", dict(lora_scale=-0.7), id="controlnet-lora-negative"),
        pytest.param("tiny-qwenimage-edit", {}, id="edit-true-cfg"),
        pytest.param(
            "tiny-qwenimage-edit", dict(height=96, width=64, true_cfg_scale=1.0), id="edit-96x64-no-cfg"
        ),
        pytest.param(
            "tiny-qwenimage-edit", dict(max_sequence_length=4, seed=9), id="edit-ignores-max-sequence-length"
        ),
        pytest.param("tiny-qwenimage-edit-plus", {}, id="edit-plus-one-picture"),
        pytest.param("tiny-qwenimage-edit-plus", dict(image_2=SECOND), id="edit-plus-two-pictures"),
        pytest.param(
            "tiny-qwenimage-edit-plus",
            dict(image_2=SECOND, image_3=THIRD, true_cfg_scale=1.0, height=96, width=64),
            id="edit-plus-three-pictures-no-cfg",
        ),
        pytest.param(
            "tiny-qwenimage-edit-plus", dict(image_3=THIRD, seed=2), id="edit-plus-a-gap-is-two-pictures"
        ),
    ],
)
def test_each_workflows_latents_and_image_equal_the_pipelines_bitwise(
    h: QwenImage, workflow: str, changes: dict[str, Any]
) -> None:
    params = h.request(workflow, **changes)

    got = h.run(h.runner, workflow, params)
    expected = h.reference(workflow, params)

    assert got.latents is not None and expected.latents is not None
    assert torch.equal(got.latents, expected.latents)
    assert np.array_equal(got.image, expected.image)
    assert np.unique(got.image).size > 10, "a flat image would make the comparison meaningless"


def test_edits_of_different_pictures_differ_and_each_equals_the_pipeline(h: QwenImage) -> None:
    params = h.request("tiny-qwenimage-edit", num_inference_steps=2)
    tall = Image.fromarray(np.random.default_rng(8).integers(0, 256, (90, 30, 3), dtype=np.uint8), "RGB")
    images = []
    for picture in (h.edit_image(), tall):
        original = h.edit_image
        h.edit_image = lambda picture=picture: picture  # type: ignore[method-assign]
        try:
            got, expected = (
                h.run(h.runner, "tiny-qwenimage-edit", params),
                h.reference("tiny-qwenimage-edit", params),
            )
        finally:
            h.edit_image = original  # type: ignore[method-assign]
        assert got.same(expected)
        images.append(got.image)

    assert not np.array_equal(images[0], images[1])


def test_the_control_encoder_samples_first_and_the_noise_continues_its_generator(h: QwenImage) -> None:
    from libs.models.qwenimage_controlnet import QwenImageControlEncode

    model = str(h.paths["tiny-qwenimage-controlnet"])
    encode, prepare = QwenImageControlEncode(), qwenimage.QwenImagePrepareLatents()
    enc = encode.execute(
        encode.load_model(model, "cpu"), control_image=h.control_image(), seed=5, height=64, width=96
    )
    components = prepare.load_model(model, "cpu")
    seeded = prepare.execute(components, seed=5, height=64, width=96, num_inference_steps=2)
    continued = prepare.execute(
        components, seed=5, height=64, width=96, num_inference_steps=2, generator_state=enc["generator_state"]
    )
    pipe = h.pipeline("tiny-qwenimage-controlnet", False)
    generator = torch.Generator().manual_seed(5)
    pixels = pipe.prepare_image(h.control_image(), 96, 64, 1, 1, "cpu", torch.float32).unsqueeze(2)
    with torch.no_grad():
        sample = pipe.vae.encode(pixels).latent_dist.sample(generator)
    noise = pipe.prepare_latents(1, 4, 64, 96, torch.float32, "cpu", generator)

    assert enc["control_latents"].shape == (1, 4 * 6, 16)
    assert torch.equal(continued["latents"], noise)
    assert not torch.equal(seeded["latents"], noise), "the ControlNet's sample comes first"
    assert sample.shape == (1, 4, 1, 8, 12)


def test_an_inpainting_controlnet_is_refused_at_load(h: QwenImage, tmp_path: Path) -> None:
    import shutil

    from diffusers import QwenImageControlNetModel

    from libs.models.qwenimage_controlnet import QwenImageControlNet

    model = tmp_path / "inpaint-controlnet"
    shutil.copytree(h.paths["tiny-qwenimage-controlnet"], model)
    config = QwenImageControlNetModel.load_config(model, subfolder="controlnet")
    QwenImageControlNetModel.from_config({**config, "extra_condition_channels": 4}).save_pretrained(
        model / "controlnet"
    )

    with pytest.raises(ValueError, match="extra_condition_channels"):
        QwenImageControlNet().load_model(str(model), "cpu")
    with pytest.raises(ValueError, match="QwenImageControlNetPipeline folder"):
        QwenImageControlNet().load_model(str(h.paths["tiny-qwenimage"]), "cpu")


def test_the_plus_edit_differs_from_the_edit_and_each_further_picture_changes_the_image(h: QwenImage) -> None:
    params = dict(num_inference_steps=2, true_cfg_scale=1.0)
    edit = h.run(h.runner, "tiny-qwenimage-edit", h.request("tiny-qwenimage-edit", **params))
    images = [
        h.run(
            h.runner, "tiny-qwenimage-edit-plus", h.request("tiny-qwenimage-edit-plus", **params, **more)
        ).image
        for more in ({}, dict(image_2=SECOND), dict(image_2=THIRD), dict(image_2=SECOND, image_3=THIRD))
    ]

    assert not np.array_equal(edit.image, images[0]), "the Plus template and resize rules differ"
    for i, a in enumerate(images):
        for b in images[i + 1 :]:
            assert not np.array_equal(a, b)


def test_the_plus_encoders_number_the_pictures_and_concatenate_their_latents(h: QwenImage) -> None:
    model = str(h.paths["tiny-qwenimage-edit"])
    more = h.more_pictures()
    pictures = dict(image=h.edit_image(), image_2=more[SECOND], image_3=more[THIRD])
    encode = qwenimage_img2img.QwenImageEditPlusImageEncode()
    out = encode.execute(encode.load_model(model, "cpu"), **pictures)
    one = encode.execute(encode.load_model(model, "cpu"), image=h.edit_image(), image_2=None, image_3=None)
    text = qwenimage_img2img.QwenImageEditPlusTextEncoder()
    prompt = "<|im_start|>user\nPicture 1: <|vision_start|>"

    sizes = [
        qwenimage_img2img.calculate_dimensions(1024 * 1024, p.size[0] / p.size[1]) for p in pictures.values()
    ]
    assert out["image_shape"].tolist() == [[h_ // 16, w // 16] for w, h_ in sizes]
    assert out["image_latents"].shape[1] == sum(w * h_ for w, h_ in sizes) // 256
    assert torch.equal(out["image_latents"][:, : one["image_latents"].shape[1]], one["image_latents"])
    assert text._picture_prompt([1, 2]).count("<|image_pad|>") == 2
    assert prompt.split("\n")[1] in text._picture_prompt([1])
    with pytest.raises(ValueError, match="needs an image"):
        encode.execute(encode.load_model(model, "cpu"), image=None)


def test_the_text_encoder_is_encode_prompt(h: QwenImage) -> None:
    node = qwenimage.QwenImageTextEncoder()
    out = node.execute(
        node.load_model(str(h.paths["tiny-qwenimage"]), "cpu"),
        prompt=PROMPT,
        negative_prompt="ugly",
        true_cfg_scale=4.0,
        max_sequence_length=20,
    )
    pipe = h.pipeline("tiny-qwenimage", False)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(PROMPT, max_sequence_length=20)
        neg, neg_mask = pipe.encode_prompt("ugly", max_sequence_length=20)

    assert out["prompt_embeds"].shape == (1, 20, 16) and mask is None and neg_mask is None
    assert torch.equal(out["prompt_embeds"], embeds) and torch.equal(out["negative_prompt_embeds"], neg)
    assert bool(out["prompt_embeds_mask"].all())
    off = node.execute(
        node.load_model(str(h.paths["tiny-qwenimage"]), "cpu"),
        prompt=PROMPT,
        negative_prompt="ugly",
        true_cfg_scale=1.0,
        max_sequence_length=20,
    )
    assert off["negative_prompt_embeds"].shape == (1, 0, 16), "no negative pass without true CFG"


def test_the_edit_encoders_are_the_edit_pipelines_encode_prompt_and_image_latents(h: QwenImage) -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    model = str(h.paths["tiny-qwenimage-edit"])
    picture = h.edit_image()
    text = qwenimage_img2img.QwenImageEditTextEncoder()
    out = text.execute(
        text.load_model(model, "cpu"),
        prompt="make it blue",
        negative_prompt="",
        true_cfg_scale=1.0,
        max_sequence_length=8,
        image=picture,
    )
    encode = qwenimage_img2img.QwenImageEditImageEncode()
    latents = encode.execute(encode.load_model(model, "cpu"), image=picture)
    pipe = h.pipeline("tiny-qwenimage-edit", False)
    width, height, _ = calculate_dimensions(1024 * 1024, picture.size[0] / picture.size[1])
    prompt_image = pipe.image_processor.resize(picture, height, width)
    pixels = pipe.image_processor.preprocess(prompt_image, height, width).unsqueeze(2)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt("make it blue", image=prompt_image)
        _, image_latents = pipe.prepare_latents(pixels, 1, 4, 64, 64, torch.float32, "cpu", None)

    assert torch.equal(out["prompt_embeds"], embeds), "the edit's encode_prompt does not truncate"
    assert out["prompt_embeds"].shape[1] > 8
    assert torch.equal(latents["image_latents"], image_latents)
    assert latents["image_shape"].tolist() == [[height // 16, width // 16]]


@pytest.mark.parametrize("size", [(60, 84), (1024, 1024), (30, 90), (517, 333)])
def test_the_edit_resize_rule_is_calculate_dimensions(size: tuple[int, int]) -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height = size
    theirs = calculate_dimensions(1024 * 1024, width / height)

    assert qwenimage_img2img.calculate_dimensions(1024 * 1024, width / height) == theirs[:2]


def test_the_transformer_loads_with_the_rope_tables_from_pretrained_computes(h: QwenImage) -> None:
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    init = QwenEmbedRope.__init__
    node = qwenimage.QwenImageTransformer()
    ours = node.load_model(str(h.paths["tiny-qwenimage"]), "cpu")["transformer"].pos_embed
    ref = QwenImageTransformer2DModel.from_pretrained(
        h.paths["tiny-qwenimage"], subfolder="transformer"
    ).pos_embed

    assert QwenEmbedRope.__init__ is init, "the patch is undone after loading"
    assert not ours.pos_freqs.is_meta and ours.pos_freqs.dtype == torch.complex64
    assert torch.equal(ours.pos_freqs, ref.pos_freqs) and torch.equal(ours.neg_freqs, ref.neg_freqs)


def test_a_guidance_distilled_transformer_is_refused(h: QwenImage, tmp_path: Path) -> None:
    from diffusers import QwenImageTransformer2DModel

    model = tmp_path / "distilled"
    transformer = QwenImageTransformer2DModel.from_pretrained(
        h.paths["tiny-qwenimage"], subfolder="transformer"
    )
    QwenImageTransformer2DModel.from_config({**transformer.config, "guidance_embeds": True}).save_pretrained(
        model / "transformer"
    )
    (model / "vae").mkdir()
    (model / "vae" / "config.json").write_text(
        (h.paths["tiny-qwenimage"] / "vae" / "config.json").read_text()
    )

    with pytest.raises(ValueError, match="guidance-distilled"):
        qwenimage.QwenImageTransformer().load_model(str(model), "cpu")


def test_the_scheduler_step_refuses_a_step_outside_the_schedule(h: QwenImage) -> None:
    prepare, step = qwenimage.QwenImagePrepareLatents(), qwenimage.QwenImageSchedulerStep()
    model = str(h.paths["tiny-qwenimage"])
    init = prepare.execute(
        prepare.load_model(model, "cpu"), seed=0, height=64, width=64, num_inference_steps=2
    )

    with pytest.raises(ValueError, match="outside"):
        step.execute(
            step.load_model(model, "cpu"),
            noise_pred=torch.zeros_like(init["latents"]),
            latents=init["latents"],
            timesteps=init["timesteps"],
            step=2,
            num_inference_steps=2,
        )


def test_the_tokenizer_reloads_with_identical_ids_and_keeps_the_special_tokens(h: QwenImage) -> None:
    from transformers import AutoTokenizer

    built = qwen_tokenizer()
    for folder in ("tokenizer", "processor"):
        loaded = AutoTokenizer.from_pretrained(h.paths["tiny-qwenimage-edit"], subfolder=folder)
        for text in [PROMPT, "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>é~<|im_end|>"]:
            assert loaded(text).input_ids == built(text).input_ids
    ids = built("<|im_start|><|image_pad|>").input_ids
    assert ids == built.convert_tokens_to_ids(["<|im_start|>", "<|image_pad|>"])


def test_build_is_idempotent_and_writes_the_manifests_last(h: QwenImage) -> None:
    root, paths = h.root, h.paths
    manifest = root / "tiny-qwenimage-edit" / MANIFEST
    before = manifest.stat().st_mtime_ns
    lora_before = paths["tiny-qwenimage-style"].stat().st_mtime_ns

    assert build(root) == paths
    assert is_built(root)
    assert manifest.stat().st_mtime_ns == before
    assert paths["tiny-qwenimage-style"].stat().st_mtime_ns == lora_before
    assert paths["tiny-qwenimage-style"] == root / "loras" / "tiny-qwenimage-style.safetensors"
    assert (root / "tiny-qwenimage-edit" / "processor" / "preprocessor_config.json").is_file()
    assert not is_built(root, seed=1)
