"""What only the Flux.2 Klein family has: every workflow's latents and image against
``Flux2KleinPipeline`` (parametrised here too, with sizes the pipeline crops), Klein's guidance
(the empty negative prompt, ``is_distilled``), the Qwen3 causal LM used as an encoder, the VAE's
batch-norm statistics, the byte-level Qwen tokenizer, and the builder.

What every family shares (warm LoRA switching, signatures, entry points, the scheduler step's
schedule check) is ``test_each_family.py``; the harness is :class:`tests.unit.model_families.Flux2`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from libs.models import flux2, flux2_workflows
from libs.models.tiny_flux2 import MANIFEST, build, is_built, qwen_tokenizer
from libs.workflow.local import LocalRunner
from tests.unit.model_families import INIT, PROMPT, REF_2, REF_3, Flux2, flux2_pipeline_result, harness

# The thread count changes the bits: pipelines and nodes alike run on one thread.
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Flux2:
    return harness("flux2", tmp_path_factory)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def model(h: Flux2) -> str:
    return str(h.paths["tiny-flux2-klein"])


@pytest.mark.parametrize(
    ("workflow", "changes"),
    [
        pytest.param("tiny-flux2-klein", {}, id="plain-cfg"),
        pytest.param("tiny-flux2-klein", dict(guidance_scale=1.0, seed=2), id="plain-no-cfg"),
        pytest.param(
            "tiny-flux2-klein", dict(height=72, width=57, seed=5), id="plain-72x57-cropped-to-72x56"
        ),
        pytest.param(
            "tiny-flux2-klein", dict(num_inference_steps=1, prompt=""), id="plain-1-step-empty-prompt"
        ),
        pytest.param("tiny-flux2-klein-lora", dict(lora_scale=0.8), id="lora-0.8"),
        pytest.param("tiny-flux2-klein-lora", dict(lora_scale=-1.5, guidance_scale=2.5), id="lora-negative"),
        pytest.param("tiny-flux2-klein-lora", dict(lora=""), id="lora-none"),
    ],
)
def test_each_workflows_latents_and_image_equal_the_klein_pipelines_bitwise(
    h: Flux2, workflow: str, changes: dict[str, Any]
) -> None:
    params = h.request(workflow, **changes)

    got = h.run(h.runner, workflow, params)
    expected = h.reference(workflow, params)

    assert got.latents is not None and expected.latents is not None
    assert torch.equal(got.latents, expected.latents)
    assert np.array_equal(got.image, expected.image)
    assert got.image.shape == (params["height"], params["width"] - params["width"] % 4, 3)
    assert np.unique(got.image).size > 10, "a flat image would make the comparison meaningless"


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({}, id="1-reference-cfg"),
        pytest.param(dict(guidance_scale=1.0, seed=3), id="1-reference-no-cfg"),
        pytest.param(dict(image_2=REF_2), id="2-references-cfg"),
        pytest.param(dict(image_2=REF_2, guidance_scale=1.0, height=96, width=64), id="2-references-no-cfg"),
        pytest.param(dict(image_2=REF_2, image_3=REF_3, seed=5), id="3-references-cfg"),
        pytest.param(
            dict(image=REF_3, image_2=INIT, image_3=REF_2, guidance_scale=1.0, height=72, width=57),
            id="3-references-no-cfg-72x57",
        ),
    ],
)
def test_the_edit_with_reference_pictures_equals_the_klein_pipeline_given_them_bitwise(
    h: Flux2, changes: dict[str, Any]
) -> None:
    """``Flux2KleinPipeline(image=[...])`` with 1-3 pictures of their own sizes and aspect ratios
    (97x70, 66x130, 151x89: rounded down and cropped), called with the request's height and width."""
    params = h.request("tiny-flux2-klein-edit", **changes)
    pictures = h.edit_pictures(params)
    assert len(pictures) == 1 + len({"image_2", "image_3"} & set(changes))

    got = h.run(h.runner, "tiny-flux2-klein-edit", params)
    expected = h.reference("tiny-flux2-klein-edit", params)
    plain = h.run(
        h.runner, h.base, h.request(h.base, **{k: v for k, v in params.items() if "image" not in k})
    )

    assert got.latents is not None and expected.latents is not None
    assert torch.equal(got.latents, expected.latents)
    assert np.array_equal(got.image, expected.image)
    assert got.image.shape == (params["height"], params["width"] - params["width"] % 4, 3)
    assert np.unique(got.image).size > 10, "a flat image would make the comparison meaningless"
    assert not np.array_equal(got.image, plain.image), "the references change the image"


def test_different_reference_pictures_give_different_images(h: Flux2) -> None:
    params = h.request("tiny-flux2-klein-edit", num_inference_steps=2)
    one = h.run(h.runner, "tiny-flux2-klein-edit", params)
    other = h.run(h.runner, "tiny-flux2-klein-edit", {**params, "image": REF_3})
    two = h.run(h.runner, "tiny-flux2-klein-edit", {**params, "image_2": REF_2})
    swapped = h.run(h.runner, "tiny-flux2-klein-edit", {**params, "image": REF_2, "image_2": INIT})

    images = [one.image, other.image, two.image, swapped.image]
    assert all(not np.array_equal(a, b) for i, a in enumerate(images) for b in images[i + 1 :])
    assert np.array_equal(h.run(h.runner, "tiny-flux2-klein-edit", params).image, one.image)


def test_the_reference_preprocessing_resizes_pictures_over_1024x1024_as_the_pipeline_does(h: Flux2) -> None:
    """What ``Flux2KleinPipeline.__call__`` hands ``prepare_image_latents`` (recorded on the way,
    before the encoding: 65k tokens are too many to run) equals the node's preprocessing, for a
    picture over 1024 x 1024 pixels (resized to that area first) after one under it."""
    from PIL import Image

    from libs.models.flux2_img2img import _condition_images

    large = Image.fromarray(np.random.default_rng(9).integers(0, 256, (1001, 1107, 3), dtype=np.uint8), "RGB")
    small = h.reference_picture(REF_2)
    pipe = h.pipeline(h.base, False)
    recorded: list[list[torch.Tensor]] = []

    class Recorded(Exception):
        pass

    def record(**kwargs: Any) -> Any:
        recorded.append(kwargs["images"])
        raise Recorded

    pipe.prepare_image_latents = record
    try:
        with pytest.raises(Recorded):
            pipe(
                prompt="x",
                image=[small, large],
                height=64,
                width=64,
                num_inference_steps=1,
                max_sequence_length=8,
            )
    finally:
        del pipe.prepare_image_latents
    got = _condition_images(pipe.image_processor, [small, large], pipe.vae_scale_factor)

    ((expected_small, expected_large),) = recorded
    # 66 x 130 rounds down to 64 x 128; 1107 x 1001 is resized to 1076 x 973 (the area 1024 x 1024),
    # then rounded down to 1076 x 972.
    assert expected_small.shape == (1, 3, 128, 64) and expected_large.shape == (1, 3, 972, 1076)
    assert torch.equal(got[0], expected_small) and torch.equal(got[1], expected_large)


def test_the_reference_encoding_refuses_what_the_pipeline_refuses(model: str) -> None:
    from PIL import Image

    from libs.models.flux2_img2img import Flux2ReferenceEncode

    node = Flux2ReferenceEncode()
    components = node.load_model(model, "cpu")
    with pytest.raises(ValueError, match="too small"):
        node.execute(components, image=Image.new("RGB", (64, 63)))
    with pytest.raises(ValueError, match="Aspect ratio too extreme"):
        node.execute(components, image=Image.new("RGB", (96, 96)), image_2=Image.new("RGB", (600, 64)))


def test_the_lora_changes_the_image_and_an_empty_lora_is_the_base_model(h: Flux2) -> None:
    base = h.run(h.runner, h.base, h.request(h.base))
    styled = h.run(h.runner, "tiny-flux2-klein-lora", h.request("tiny-flux2-klein-lora"))
    unstyled = h.run(h.runner, "tiny-flux2-klein-lora", h.request("tiny-flux2-klein-lora", lora=""))

    assert not np.array_equal(base.image, styled.image)
    assert np.array_equal(unstyled.image, base.image) and torch.equal(unstyled.latents, base.latents)


def test_a_step_distilled_checkpoint_ignores_guidance_as_the_pipeline_does(
    h: Flux2, model: str, tmp_path: Path
) -> None:
    distilled = tmp_path / "tiny-flux2-klein-distilled"
    shutil.copytree(model, distilled)
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    spec = flux2_workflows.workflows(model=str(distilled))[0]
    params = h.request(h.base, guidance_scale=4.0)

    got = LocalRunner(tmp_path, classes=h.classes()).run(spec, params)["image"].numpy()
    latents = h.decoded[-1]
    expected = h.reference(h.base, params, model=distilled)
    guided = h.run(h.runner, h.base, params)

    assert np.array_equal(got, expected.image) and torch.equal(latents, expected.latents)
    assert not np.array_equal(got, guided.image), "the base checkpoint guides at 4.0"
    assert np.array_equal(got, h.run(h.runner, h.base, h.request(h.base, guidance_scale=1.0)).image)


def test_the_text_encoder_matches_encode_prompt_with_the_empty_negative_when_guiding(
    h: Flux2, model: str
) -> None:
    node = flux2.Flux2TextEncoder()
    components = node.load_model(model, "cpu")
    pipe = h.pipeline(h.base, False)

    guided = node.execute(components, prompt=PROMPT, guidance_scale=4.0, max_sequence_length=40)
    plain = node.execute(components, prompt=PROMPT, guidance_scale=1.0, max_sequence_length=40)
    with torch.no_grad():  # as in __call__; grad mode changes the bits
        embeds, text_ids = pipe.encode_prompt(PROMPT, max_sequence_length=40)
        negative, negative_ids = pipe.encode_prompt("", max_sequence_length=40)

    assert components["out_layers"] == (9, 18, 27)
    assert guided["prompt_embeds"].shape == (2, 40, 48) and plain["prompt_embeds"].shape == (1, 40, 48)
    assert torch.equal(guided["prompt_embeds"], torch.cat([embeds, negative]))
    assert torch.equal(guided["text_ids"], torch.cat([text_ids, negative_ids]))
    assert torch.equal(plain["prompt_embeds"], embeds) and torch.equal(plain["text_ids"], text_ids)


def test_the_decoder_stack_gives_the_causal_lms_hidden_states(h: Flux2) -> None:
    text_encoder = h.pipeline(h.base, False).text_encoder
    ids = torch.tensor([[257, 84, 82, 68, 81, 198, 256, 256]])
    mask = (ids != 256).long()

    with torch.no_grad():
        lm = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        stack = text_encoder.model(
            input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False
        )

    assert len(lm.hidden_states) == len(stack.hidden_states) == 28
    assert all(torch.equal(a, b) for a, b in zip(lm.hidden_states, stack.hidden_states, strict=True))


def test_the_transformer_refuses_embeddings_that_do_not_fit_the_requests_guidance(model: str) -> None:
    text, prepare, transformer = (
        flux2.Flux2TextEncoder(),
        flux2.Flux2PrepareLatents(),
        flux2.Flux2Transformer(),
    )
    embedded = text.execute(
        text.load_model(model, "cpu"), prompt="a cat", guidance_scale=1.0, max_sequence_length=16
    )
    init = prepare.execute(
        prepare.load_model(model, "cpu"), seed=0, height=32, width=32, num_inference_steps=2
    )
    components = transformer.load_model(model, "cpu")

    with pytest.raises(ValueError, match="needs 2"):
        transformer.execute(
            components,
            latents=init["latents"],
            timesteps=init["timesteps"],
            step=0,
            guidance_scale=4.0,
            prompt_embeds=embedded["prompt_embeds"],
            text_ids=embedded["text_ids"],
            latent_ids=init["latent_ids"],
        )


def test_the_vae_decode_undoes_the_batch_norm_statistics_the_builder_drew(h: Flux2, model: str) -> None:
    vae = h.pipeline(h.base, False).vae

    assert not torch.allclose(vae.bn.running_mean, torch.zeros_like(vae.bn.running_mean))
    assert not torch.allclose(vae.bn.running_var, torch.ones_like(vae.bn.running_var))
    node = flux2.Flux2VaeDecode()
    components = node.load_model(model, "cpu")
    assert torch.equal(components["vae"].bn.running_var, vae.bn.running_var)


def test_the_qwen_tokenizer_reloads_from_the_saved_folder_with_identical_ids(model: str) -> None:
    from transformers import Qwen2TokenizerFast

    built = qwen_tokenizer()
    loaded = Qwen2TokenizerFast.from_pretrained(model, subfolder="tokenizer")
    for prompt in [PROMPT, "", "line one\nline two ~é~ 123"]:
        text = loaded.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        assert text.startswith("<|im_start|>user\n") and text.endswith("<think>\n\n</think>\n\n")
        ids = built(text).input_ids
        assert loaded(text).input_ids == ids
        assert ids[0] == built.convert_tokens_to_ids("<|im_start|>")
    assert loaded.pad_token == "<|endoftext|>"


def test_build_is_idempotent_and_writes_the_manifests_last(h: Flux2) -> None:
    root, paths = h.root, h.paths
    manifest = root / "tiny-flux2-klein" / MANIFEST
    before = manifest.stat().st_mtime_ns
    lora_before = paths["tiny-flux2-style"].stat().st_mtime_ns

    assert build(root) == paths
    assert is_built(root) and not is_built(root, seed=1)
    assert manifest.stat().st_mtime_ns == before
    assert paths["tiny-flux2-style"].stat().st_mtime_ns == lora_before
    assert paths["tiny-flux2-style"] == root / "loras" / "tiny-flux2-style.safetensors"
    assert json.loads((root / "tiny-flux2-klein" / "model_index.json").read_text())["is_distilled"] is False


def test_the_decode_nodes_unpacking_and_denormalisation_give_the_pipelines_latent_output(h: Flux2) -> None:
    params = h.request(h.base, num_inference_steps=2)
    pipe = h.pipeline(h.base, False)
    packed = flux2_pipeline_result(pipe, params).latents
    expected = pipe(
        prompt=params["prompt"],
        height=params["height"],
        width=params["width"],
        num_inference_steps=2,
        guidance_scale=params["guidance_scale"],
        generator=torch.Generator().manual_seed(params["seed"]),
        max_sequence_length=params["max_sequence_length"],
        output_type="latent",
    ).images

    assert packed is not None and packed.shape == (1, 16 * 24, 16)
    ids = flux2._latent_ids(torch.zeros(1, 16, 16, 24))
    bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
    unpacked = flux2._unpack_with_ids(packed, ids, 16, 24)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps)
    got = flux2._unpatchify(unpacked * std + bn.running_mean.view(1, -1, 1, 1))
    assert expected.shape == (1, 4, 32, 48) and torch.equal(got, expected)


def test_a_workflow_loaded_at_bf16_equals_the_pipeline_loaded_at_bf16_bitwise(h: Flux2, model: str) -> None:
    """The noise is drawn in the text encoder's dtype as the executor loads it (bf16 on CUDA by
    default), not the fp32 saved in its config; the batch-norm statistics follow the latents."""
    from diffusers import Flux2KleinPipeline

    from libs.dataplane.loader import Loader
    from services.executor.runtime import ModelCache, parse_dtypes

    pipe = Flux2KleinPipeline.from_pretrained(model, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    params = h.request(h.base, num_inference_steps=2)
    with Loader() as loader:
        cache = ModelCache(h.root, "cpu", loader, parse_dtypes(f"{h.base}=bfloat16"))
        got = h.run(LocalRunner(h.root, classes=h.classes(), models=cache), h.base, params)
        transformer = cache.components("flux2.transformer", h.base)[0]["transformer"]

    expected = flux2_pipeline_result(pipe, params)
    assert got.latents is not None and got.latents.dtype == torch.bfloat16
    assert torch.equal(got.latents, expected.latents) and np.array_equal(got.image, expected.image)
    assert {p.dtype for p in transformer.parameters()} == {torch.bfloat16}


def test_the_plain_and_inpaint_workflows_run_one_transformer_which_binds_the_reference_tokens_by_name() -> (
    None
):
    """Inpainting's picture reaches ``flux2.transformer`` as its optional reference tokens, so a
    plain and an inpainting request load the same (fn, model) instead of a second transformer."""
    from libs.workflow.dag import TensorSource, unroll
    from libs.workflow.params import resolve_params

    specs = {s.name: s for s in flux2_workflows.workflows()}
    given = {"prompt": "x", "image": "init", "mask": "mask", "num_inference_steps": 3}
    steps = {}
    for name in ("tiny-flux2-klein", "tiny-flux2-klein-inpaint"):
        spec = specs[name]
        dag = unroll(spec, resolve_params(spec, {k: v for k, v in given.items() if k in spec.params}))
        steps[name] = [n for n in dag.nodes.values() if n.fn == "flux2.transformer"]

    assert {(n.fn, n.model) for ns in steps.values() for n in ns} == {
        ("flux2.transformer", "tiny-flux2-klein")
    }
    assert all("image_latents" not in n.inputs for n in steps["tiny-flux2-klein"])
    for node in steps["tiny-flux2-klein-inpaint"]:
        assert node.inputs["image_latents"] == TensorSource("prepare", "image_latents")
        assert node.inputs["image_latent_ids"] == TensorSource("prepare", "image_latent_ids")


def test_the_edit_takes_up_to_three_uploaded_pictures_and_only_edits() -> None:
    """``/v1/images/edits`` fills ``image``, ``image_2``, ``image_3`` in upload order; a picture left
    out resolves to ``""`` and reaches ``flux2.reference_encode`` as none."""
    from libs.workflow.capabilities import capabilities, image_params
    from libs.workflow.dag import Const, ImageSource, unroll
    from libs.workflow.params import resolve_params

    (spec,) = [s for s in flux2_workflows.workflows() if s.name == "tiny-flux2-klein-edit"]
    assert capabilities(spec) == ["edit"] and image_params(spec) == ["image", "image_2", "image_3"]
    resolved = resolve_params(spec, {"prompt": "x", "image": "a", "image_2": "b"})
    assert resolved["image_3"] == ""
    (node,) = [n for n in unroll(spec, resolved).nodes.values() if n.fn == "flux2.reference_encode"]
    assert node.inputs == {"image": ImageSource("a"), "image_2": ImageSource("b"), "image_3": Const(None)}
