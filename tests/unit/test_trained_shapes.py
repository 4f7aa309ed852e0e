"""The trained shapes model (libs/trained, docs/trained-model.md): the procedural data set is a
function of its seed, the evaluator reads generator images right and refuses wrong captions, the
committed checkpoint loads as a FluxPipeline, the ``flux-shapes`` workflow run node by node equals
that pipeline bit for bit and draws held-out captions the evaluator accepts, and a short training
run is reproducible from its seed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from libs.models import families
from libs.models.build_utils import read_manifest
from libs.models.flux_workflows import MODELFNS
from libs.trained import catalog, evaluate, shapes, train
from libs.workflow.local import LocalRunner

# Per attribute, a few points under what `python -m libs.trained.train` measured on the held-out
# captions (checkpoints/tiny-flux-shapes/training.json: 180 images) and under what these 45 images
# with other seeds score; chance is 1/3 for shape, 1/2 for count, 1/5 for colour.
# The committed model gets position, background and count right, colour only somewhat better
# than chance, shape at chance (docs/trained-model.md says so): no floor for shape.
HELD_OUT_FLOORS = {"position": 0.9, "background": 0.9, "count": 0.7, "colour": 0.3, "all": 0.1}
SEED_BASE = 1000


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread count changes the bits
    yield
    torch.set_num_threads(before)


# -- the data set --------------------------------------------------------------------------------


def test_the_generator_is_a_function_of_its_seed() -> None:
    scenes, images = shapes.dataset(24, seed=3)
    again_scenes, again = shapes.dataset(24, seed=3)
    assert scenes == again_scenes and np.array_equal(images, again)
    assert images.shape == (24, 64, 64, 3) and images.dtype == np.uint8
    other_scenes, other = shapes.dataset(24, seed=4)
    assert other_scenes != scenes and not np.array_equal(other, images)
    # Image i does not depend on how many are drawn.
    assert np.array_equal(shapes.sample(5, 3)[1], images[5])


def test_captions_follow_the_grammar_and_parse_back() -> None:
    scene = shapes.Scene("circle", "red", "left", "white", "one")
    assert scene.caption == "a red circle on the left on a white background"
    two = shapes.Scene("triangle", "blue", "top", "grey", "two")
    assert two.caption == "two blue triangles at the top on a grey background"
    for s in shapes.all_scenes():
        assert shapes.parse_caption(s.caption) == s
    for bad in ("a red fox in the snow", "two red circle on the left on a white background", ""):
        with pytest.raises(ValueError):
            shapes.parse_caption(bad)


def test_the_held_out_combinations_are_never_trained_on() -> None:
    assert len(shapes.HELD_OUT) == 45 and len(shapes.TRAIN) == 405
    assert not set(shapes.HELD_OUT) & set(shapes.TRAIN)
    assert set(shapes.HELD_OUT) | set(shapes.TRAIN) == set(shapes.all_scenes())
    trained = {s.caption for s in shapes.dataset(500, seed=0)[0]}
    assert trained and not trained & {s.caption for s in shapes.HELD_OUT}
    for field in ("shape", "colour", "position", "background", "count"):  # every value is trained
        assert {getattr(s, field) for s in shapes.TRAIN} == {getattr(s, field) for s in shapes.all_scenes()}


# -- the evaluator -------------------------------------------------------------------------------


def test_the_evaluator_reads_every_attribute_of_generator_images() -> None:
    scenes, images = shapes.dataset(450, seed=11, scenes=shapes.all_scenes())
    verdicts = [evaluate.score(img, s.caption) for s, img in zip(scenes, images, strict=True)]
    assert evaluate.accuracy(verdicts) == {a: 1.0 for a in (*evaluate.ATTRIBUTES, "all")}
    v = verdicts[0]
    assert v.predicted == dataclasses.asdict(scenes[0]) and v.all and "matches" in v.summary()


@pytest.mark.parametrize("attribute", evaluate.ATTRIBUTES)
def test_the_evaluator_rejects_a_caption_wrong_in_one_attribute(attribute: str) -> None:
    values = {
        "shape": shapes.SHAPES,
        "colour": tuple(shapes.COLOURS),
        "position": tuple(shapes.POSITIONS),
        "background": tuple(shapes.BACKGROUNDS),
        "count": shapes.COUNTS,
    }[attribute]
    scenes, images = shapes.dataset(40, seed=5, scenes=shapes.all_scenes())
    for scene, image in zip(scenes, images, strict=True):
        for wrong in values:
            if wrong == getattr(scene, attribute):
                continue
            verdict = evaluate.score(image, dataclasses.replace(scene, **{attribute: wrong}).caption)
            assert not verdict.all and not verdict.matches[attribute]
            assert all(verdict.matches[a] for a in evaluate.ATTRIBUTES if a != attribute)


def test_the_evaluator_finds_nothing_in_an_empty_or_noisy_picture() -> None:
    caption = "a red circle on the left on a white background"
    blank = np.full((64, 64, 3), 255, dtype=np.uint8)
    verdict = evaluate.score(blank, caption)
    assert verdict.predicted["count"] == "0" and not verdict.all and verdict.matches["background"]
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert not evaluate.score(noise, caption).all
    # Any size is scored at 64x64: a 128x128 upscale of a generator image still matches.
    from PIL import Image

    scene, image = shapes.sample(0, 1)
    big = Image.fromarray(image).resize((128, 128), Image.Resampling.NEAREST)
    assert evaluate.score(big, scene.caption).all


# -- the committed checkpoint, served --------------------------------------------------------------


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shapes-models")
    catalog.install(root)
    return root


@pytest.fixture(scope="module")
def pipe() -> Any:
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(catalog.CHECKPOINT)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def runner(model_root: Path) -> LocalRunner:
    return LocalRunner(model_root, classes={cls.fn_name: cls for cls in MODELFNS})


def test_the_checkpoint_is_a_small_flux_pipeline_folder_and_installs_once(
    model_root: Path, pipe: Any
) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    assert isinstance(pipe.transformer, FluxTransformer2DModel) and isinstance(pipe.vae, AutoencoderKL)
    assert isinstance(pipe.text_encoder, CLIPTextModel) and isinstance(pipe.text_encoder_2, T5EncoderModel)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert not pipe.transformer.config.guidance_embeds and pipe.vae.config.scaling_factor != 1.0
    size = sum(p.stat().st_size for p in catalog.CHECKPOINT.rglob("*") if p.is_file())
    assert size < 8 * 2**20
    report = json.loads((catalog.CHECKPOINT / train.REPORT).read_text())
    assert all(report["held_out_accuracy"][a] >= f for a, f in HELD_OUT_FLOORS.items()), report
    assert report["generator_accuracy"]["all"] == 1.0
    installed = model_root / catalog.MODEL
    assert read_manifest(installed / "t2i-model.json")["sha256"] == catalog.checkpoint_hash()
    assert catalog.checkpoint_hash(installed) == catalog.checkpoint_hash()
    stamp = (installed / "t2i-model.json").stat().st_mtime_ns
    assert catalog.install(model_root) == {catalog.MODEL: installed}
    assert (installed / "t2i-model.json").stat().st_mtime_ns == stamp  # left alone


def test_flux_shapes_is_in_the_catalog_with_the_evaluated_sampling_defaults() -> None:
    spec = next(s for s in families.workflows() if s.name == catalog.NAME)
    assert spec.sizes == ["64x64"]
    assert spec.params["num_inference_steps"].default == catalog.STEPS == train.EVAL_STEPS
    assert spec.params["guidance_scale"].default == 0.0
    assert spec.params["max_sequence_length"].default == 16


def _workflow_image(runner: LocalRunner, caption: str, seed: int) -> np.ndarray:
    spec = catalog.flux_shapes()
    params = {name: p.default for name, p in spec.params.items() if p.default is not None}
    params.update(prompt=caption, seed=seed)
    image = runner.run(spec, params)["image"]
    assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8
    return image.numpy()


def test_the_workflow_equals_the_pipeline_bitwise(runner: LocalRunner, pipe: Any) -> None:
    for i, scene in enumerate(shapes.HELD_OUT[:3]):
        ours = _workflow_image(runner, scene.caption, SEED_BASE + i)
        theirs = train.generate(pipe, scene.caption, SEED_BASE + i, catalog.STEPS)
        assert np.array_equal(ours, theirs), scene.caption


def test_the_workflow_draws_held_out_captions_the_evaluator_accepts(runner: LocalRunner) -> None:
    verdicts = [
        evaluate.score(_workflow_image(runner, scene.caption, SEED_BASE + i), scene.caption)
        for i, scene in enumerate(shapes.HELD_OUT)
    ]
    accuracy = evaluate.accuracy(verdicts)
    assert all(accuracy[a] >= f for a, f in HELD_OUT_FLOORS.items()), accuracy


# -- training ------------------------------------------------------------------------------------


def test_a_short_training_run_is_reproducible_from_its_seed() -> None:
    def run(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        pipe, figures = train.train(seed, images=32, vae_steps=2, steps=2, batch=4, log=lambda _: None)
        weights = {
            f"{part}.{k}": v.clone()
            for part in ("transformer", "vae")
            for k, v in getattr(pipe, part).state_dict().items()
        }
        return weights, figures

    a, fa = run(0)
    b, fb = run(0)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert fa["transformer_final_loss"] == fb["transformer_final_loss"]
    assert fa["vae_scaling_factor"] == fb["vae_scaling_factor"]
    c, _ = run(1)
    assert any(not torch.equal(a[k], c[k]) for k in a)
