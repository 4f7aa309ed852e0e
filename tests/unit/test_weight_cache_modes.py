"""The baselines' cache granularity on the real executor's weight cache (tiny Flux on CPU), not only
in the pure policy and the simulator: MCache keeps or evicts whole models, WCache holds a copy per
workflow and evicts a workflow whole, NoCache keeps nothing once its request ends. A model brought
back after any of these has exactly the weights it was loaded with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from libs.dataplane.loader import Loader
from libs.models import tiny_flux
from libs.protocol.ids import ModelKey
from services.executor.runtime import ModelCache
from tests.unit.test_weight_cache import CLIP, TRANSFORMER, VAE, sizes, weights_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("weights")
    tiny_flux.build(out)
    return out


@pytest.fixture
def loader() -> Iterator[Loader]:
    with Loader() as loader:
        yield loader


def run(cache: ModelCache, key: ModelKey, workflow: str = "") -> tuple[dict[str, torch.nn.Module], float]:
    """One node's use of a model: acquire, (the run), release; the fraction it had to load."""
    held = cache.acquire(key.fn, key.model, workflow)
    return held.components, cache.release(held).frac


def residency(cache: ModelCache) -> dict[ModelKey, tuple[int, int]]:
    return {k: (v[0], v[1]) for k, v in cache.cached().items()}


def test_mcache_evicts_whole_models_and_a_model_comes_back_whole(root: Path, loader: Loader) -> None:
    size = sizes(root, loader)
    budget = size[TRANSFORMER] + size[CLIP]  # not all three
    cache = ModelCache(root, "cpu", loader, budget=budget, granularity="model")
    comps, _ = run(cache, TRANSFORMER)
    first = weights_of(comps["transformer"])
    run(cache, CLIP)
    run(cache, VAE)  # evicts the least recently used model (the transformer), all of it
    held = residency(cache)
    assert TRANSFORMER not in held and held[CLIP][0] == held[CLIP][1] and held[VAE][0] == held[VAE][1]
    for resident, layers in held.values():
        assert resident == layers  # never part of a model
    comps, frac = run(cache, TRANSFORMER)
    assert frac == 1.0  # a whole load: no prefix was kept
    again = weights_of(comps["transformer"])
    assert all(torch.equal(first[n], again[n]) for n in first)


def test_wcache_keeps_a_copy_per_workflow_and_evicts_a_workflow_whole(root: Path, loader: Loader) -> None:
    size = sizes(root, loader)
    budget = size[TRANSFORMER] + size[VAE] + size[CLIP] // 2  # one workflow's pair, not two
    cache = ModelCache(root, "cpu", loader, budget=budget, granularity="workflow")
    run(cache, TRANSFORMER, "wf-a")
    run(cache, VAE, "wf-a")
    assert run(cache, TRANSFORMER, "wf-a")[1] == 0.0  # its own workflow's copy: a hit
    comps, frac = run(cache, TRANSFORMER, "wf-b")  # the same model for another workflow: its own copy
    assert frac == 1.0
    keys = set(cache.weights.models)
    assert len([k for k in keys if TRANSFORMER in (k if isinstance(k, tuple) else (k,))]) == 2
    run(cache, VAE, "wf-b")  # wf-a (least recently used) goes, both its models
    resident = cache.weights.snapshot()
    kept = {k for k, v in resident.items() if v[0] > 0}
    assert all("wf-a" not in (k if isinstance(k, tuple) else ()) for k in kept), kept
    assert any("wf-b" in (k if isinstance(k, tuple) else ()) for k in kept), kept


def test_nocache_keeps_nothing_once_its_request_ends(root: Path, loader: Loader) -> None:
    cache = ModelCache(root, "cpu", loader, granularity="none")
    cache.weights.begin_request("r1")
    comps, _ = run(cache, TRANSFORMER)
    first = weights_of(comps["transformer"])
    assert run(cache, TRANSFORMER)[1] == 0.0  # within its request (the steps of a loop): kept
    cache.weights.end_request("r1")
    assert residency(cache) == {}
    cache.weights.begin_request("r2")
    comps, frac = run(cache, TRANSFORMER)
    assert frac == 1.0
    again = weights_of(comps["transformer"])
    assert all(torch.equal(first[n], again[n]) for n in first)
