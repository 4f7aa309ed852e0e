"""What only the Sana family has: a multistep DPM-Solver whose history travels between nodes, a
ControlNet saved on its own, the scheduler step's history check, the text encoder's instruction and
select_index, the Gemma tokenizer, and the builder.

What every family shares (each workflow equals SanaPipeline / SanaControlNetPipeline bitwise, warm
LoRA switching, mid-forward fetches, signatures, entry points) is ``test_each_family.py``; the
harness is :class:`tests.unit.model_families.Sana`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from libs.models import sana, sana_controlnet, sana_workflows
from libs.models.tiny_sana import MANIFEST, build, gemma_tokenizer, is_built
from libs.workflow.local import LocalRunner
from tests.unit.model_families import PROMPT, Sana, harness, sana_pipeline_image

# diffusers' DPM-Solver builds its sigmas with np.array(tensor, copy=False) (numpy 2 warns).

MAX_SEQ = 24
BASE = dict(prompt=PROMPT, num_inference_steps=3, max_sequence_length=MAX_SEQ)


# The thread count changes the bits: pipelines and nodes alike run on one thread.
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Sana:
    return harness("sana", tmp_path_factory)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def root(h: Sana) -> Path:
    return h.root


@pytest.fixture(scope="module")
def paths(h: Sana) -> dict[str, Path]:
    return h.paths


@pytest.fixture(scope="module")
def pipes(h: Sana) -> dict[str, Any]:
    return {"tiny-sana": h.pipeline(False, False), "tiny-sana-controlnet": h.pipeline(True, False)}


@pytest.mark.parametrize(
    "scheduler_kwargs",
    [
        pytest.param(dict(solver_order=2), id="order2-like-released-sana"),
        pytest.param(dict(solver_order=3, lower_order_final=False), id="order3"),
    ],
)
def test_a_multistep_dpm_solver_carries_its_history_between_nodes_and_stays_bitwise_equal(
    scheduler_kwargs: dict[str, Any], h: Sana, paths: dict[str, Path], tmp_path: Path
) -> None:
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline

    # Released Sana checkpoints ship this scheduler (flow prediction, flow sigmas, DPM-Solver++).
    pipe = SanaPipeline.from_pretrained(paths["tiny-sana"])
    pipe.scheduler = DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++",
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        **scheduler_kwargs,
    )
    pipe.set_progress_bar_config(disable=True)
    model = tmp_path / "tiny-sana-dpm"
    pipe.save_pretrained(model)
    params = {**BASE, "num_inference_steps": 5, "height": 512, "width": 512, "seed": 9}

    spec = sana_workflows.workflows(model=str(model))[0]  # tiny-sana on this folder
    got = LocalRunner(tmp_path, classes=h.classes()).run(spec, params)["image"]

    assert np.array_equal(got.numpy(), sana_pipeline_image(pipe, **params))


def test_a_controlnet_saved_on_its_own_loads_like_the_one_in_the_pipeline_folder(
    paths: dict[str, Path], pipes: dict[str, Any], tmp_path: Path
) -> None:
    pipes["tiny-sana-controlnet"].controlnet.save_pretrained(tmp_path / "controlnet")
    node = sana_controlnet.SanaControlNet()
    alone = node.load_model(str(tmp_path / "controlnet"), "cpu")["controlnet"].state_dict()
    in_folder = node.load_model(str(paths["tiny-sana-controlnet"]), "cpu")["controlnet"].state_dict()

    assert alone.keys() == in_folder.keys()
    assert all(torch.equal(alone[k], in_folder[k]) for k in alone)
    spec = sana_workflows.sana_workflow(
        "x", "tiny-sana", sizes=["512x512"], controlnet=True, controlnet_model="sana-controlnet"
    )
    assert {op.id: op.model for op in spec.body[-2].body} == {
        "controlnet": "sana-controlnet",
        "transformer": "tiny-sana",
        "scheduler": "tiny-sana",
    }


def test_the_scheduler_step_starts_with_an_empty_history_and_refuses_a_wrong_one(
    paths: dict[str, Path],
) -> None:
    prepare, step = sana.SanaPrepareLatents(), sana.SanaSchedulerStep()
    model = str(paths["tiny-sana"])
    init = prepare.execute(
        prepare.load_model(model, "cpu"),
        seed=0,
        height=64,
        width=64,
        num_inference_steps=4,
        use_resolution_binning=False,
    )
    components = step.load_model(model, "cpu")
    latents = init["latents"]
    inputs = dict(noise_pred=torch.zeros_like(latents), latents=latents, timesteps=init["timesteps"], step=0)

    # (another schedule's timesteps are refused: test_each_family)
    assert init["solver_history"].shape == (0, *latents.shape)
    with pytest.raises(ValueError, match="solver_history"):
        step.execute(components, **inputs, num_inference_steps=4, solver_history=latents[None])


def test_the_text_encoder_matches_encode_prompt_with_the_instruction_and_the_select_index(
    paths: dict[str, Path], pipes: dict[str, Any]
) -> None:
    node = sana.SanaTextEncoder()
    components = node.load_model(str(paths["tiny-sana"]), "cpu")
    out = node.execute(
        components,
        prompt=PROMPT,
        negative_prompt="ugly",
        guidance_scale=4.5,
        max_sequence_length=MAX_SEQ,
        complex_human_instruction=True,
    )
    pipe = pipes["tiny-sana"]
    chi = components["complex_human_instruction"]
    with torch.no_grad():  # as in SanaPipeline.__call__; grad mode changes the bits
        embeds, mask, neg_embeds, neg_mask = pipe.encode_prompt(
            PROMPT, True, negative_prompt="ugly", max_sequence_length=MAX_SEQ, complex_human_instruction=chi
        )

    assert len(chi) > 1 and chi[-1].startswith("User Prompt")
    assert out["prompt_embeds"].shape == (2, MAX_SEQ, 16)
    assert torch.equal(out["prompt_embeds"], torch.cat([neg_embeds, embeds]))
    assert torch.equal(out["prompt_attention_mask"], torch.cat([neg_mask, mask]))
    assert out["prompt_attention_mask"][1, 0] == 1  # select_index keeps the <bos>


def test_the_gemma_tokenizer_reloads_from_the_saved_folder_with_identical_ids(paths: dict[str, Path]) -> None:
    from transformers import GemmaTokenizer, GemmaTokenizerFast

    built = gemma_tokenizer()
    loaded = GemmaTokenizer.from_pretrained(paths["tiny-sana"], subfolder="tokenizer")
    for prompt in [PROMPT, "a cat", "line one\nline two ~é~ 123"]:
        ids = built(prompt).input_ids
        assert loaded(prompt).input_ids == ids
        assert ids[0] == built.bos_token_id == 2
        assert built.unk_token_id not in ids, "the byte fallback covers every character"
    fast = GemmaTokenizerFast.from_pretrained(paths["tiny-sana"], subfolder="tokenizer")
    assert fast(PROMPT).input_ids == built(PROMPT).input_ids


def test_build_is_idempotent_and_writes_the_manifests_last(root: Path, paths: dict[str, Path]) -> None:
    manifest = root / "tiny-sana" / MANIFEST
    before = manifest.stat().st_mtime_ns
    lora_before = paths["tiny-sana-style"].stat().st_mtime_ns

    assert build(root) == paths
    assert is_built(root)
    assert manifest.stat().st_mtime_ns == before
    assert paths["tiny-sana-style"].stat().st_mtime_ns == lora_before
    assert paths["tiny-sana-style"] == root / "loras" / "tiny-sana-style.safetensors"
    assert (root / "tiny-sana-controlnet" / "controlnet" / "config.json").is_file()
    assert not is_built(root, seed=1)
