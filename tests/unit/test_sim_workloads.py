"""The S1/S2 workflows (libs/sim/settings.py) and their profile (libs/sim/profiles/paper-s.json)."""

from __future__ import annotations

import pytest

from libs.sim.profile import load_profile
from libs.sim.settings import BASES, SETTINGS, catalog, eval_workflow, models_of, solo_latency, workflow_bytes
from libs.workflow import catalog as installed
from libs.workflow.dag import unroll
from libs.workflow.validate import validate_spec

PROFILE = load_profile("paper-s")
ALL = {s.name: s for name in SETTINGS for s in SETTINGS[name]()}


def test_settings_have_the_papers_sizes() -> None:
    s1, s2 = SETTINGS["s1"](), SETTINGS["s2"]()
    assert len(s1) == 5 and len(s2) == 20
    assert len({s.name for s in s2}) == 20
    assert {s.name for s in s1} <= {s.name for s in s2}
    assert {models_of(s)[2] for s in s2} >= {BASES[b].dit for b in BASES}  # every base model


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_workflow_validates_unrolls_and_is_profiled(name: str) -> None:
    # The installed catalog plus the simulated ModelFns (sim.controlnet and sim.lora need their
    # entry points in pyproject.toml before a registry knows them).
    sigs = {**installed.signatures(), **catalog()}
    spec = validate_spec(ALL[name], sigs)
    params = {n: ("x" if p.required else p.default) for n, p in spec.params.items()}
    dag = unroll(spec, params)
    steps = spec.params["num_inference_steps"].default
    assert sum(n.fn == "sim.denoiser" for n in dag.nodes.values()) == steps
    for model in models_of(spec):
        assert PROFILE.model(model) is not None, model
    for fig_model in PROFILE.models.values():
        for fig in (fig_model.size_gb, fig_model.load_s, fig_model.exec_s):
            assert fig.tag in "MDP" and fig.source


def test_solo_latency_follows_the_profile() -> None:
    m = PROFILE.models
    flux = solo_latency(eval_workflow("flux1-dev"), PROFILE)
    expected = (
        28 * 0.235 + m["flux1/text"].exec_s.value + m["prepare"].exec_s.value + m["flux1/vae"].exec_s.value
    )
    assert flux.serial == pytest.approx(expected, rel=1e-6)
    assert flux.serial == pytest.approx(6.7, rel=0.02)  # docs/profiles.md, Whole workflows
    assert flux.critical == pytest.approx(expected - 0.001, rel=1e-6)  # noise drawn beside the text
    loads = sum(m[k].load_s.value for k in ("flux1/text", "flux1-dev/dit", "flux1/vae"))
    assert flux.cold_serial == pytest.approx(expected + loads, rel=1e-6)
    assert flux.critical < flux.cold_critical < flux.cold_serial
    assert solo_latency(eval_workflow("flux1-schnell"), PROFILE).serial == pytest.approx(1.0, rel=0.03)
    assert solo_latency(eval_workflow("z-image-turbo"), PROFILE).serial == pytest.approx(
        8 * 0.17 + 0.129 + 0.001 + 0.05, rel=1e-6
    )
    assert solo_latency(eval_workflow("sd3.5-large"), PROFILE).serial == pytest.approx(6.5, rel=0.02)


def test_adapters_add_their_cost() -> None:
    plain = solo_latency(eval_workflow("flux1-dev"), PROFILE)
    lora = solo_latency(eval_workflow("flux1-dev", lora="a"), PROFILE)
    cn = solo_latency(eval_workflow("flux1-dev", controlnet=True), PROFILE)
    assert lora.serial == pytest.approx(plain.serial + 28 * 0.0235, rel=1e-6)
    assert cn.serial == pytest.approx(plain.serial + 28 * 0.06, rel=1e-6)
    assert cn.critical == pytest.approx(plain.critical, rel=1e-6)  # the ControlNet runs beside the DiT


def test_shared_components_share_model_keys() -> None:
    def keys(base: str, **kw) -> set[str]:
        return set(models_of(eval_workflow(base, **kw)))

    assert "flux1/text" in keys("flux1-dev") & keys("flux1-schnell")
    assert "flux1/vae" in keys("flux1-dev") & keys("flux1-schnell")
    qwen = keys("z-image") & keys("z-image-turbo") & keys("flux2-klein-4b")
    assert "qwen3-4b/text" in qwen
    cn = keys("flux1-dev", controlnet=True) & keys("flux1-schnell", controlnet=True)
    assert "flux1/controlnet-union" in cn
    assert "flux1-dev/dit" in keys("flux1-dev", lora="a") & keys("flux1-dev", controlnet=True)
    assert keys("flux1-dev", lora="a") - keys("flux1-dev") == {"flux1-dev/lora-a"}
    sizes = workflow_bytes(eval_workflow("flux1-dev"), PROFILE)
    assert sum(sizes.values()) / 1e9 == pytest.approx(33.72, abs=0.01)  # the paper's 33.7 GB


def test_every_simulated_base_model_names_the_catalog_workflow_it_stands_for() -> None:
    """The evaluation's models exist for real: each simulated base names a catalog workflow of its
    architecture, which has the simulated one's ControlNet and LoRA variants too where S2 uses them."""
    from libs.models import families
    from libs.sim.settings import BASES, S2_VARIANTS

    catalog = {w.name for w in families.workflows()}
    for base in BASES.values():
        assert base.real in catalog, (base.name, base.real)
    for base, controlnet, lora in S2_VARIANTS:
        real = BASES[base].real
        variant = real + ("-controlnet" if controlnet else "") + ("-lora" if lora else "")
        assert variant in catalog, (base, controlnet, lora, variant)
