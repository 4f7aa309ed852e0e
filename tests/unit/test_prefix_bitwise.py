"""Every catalog workflow, run over an executor's weight cache with each model trimmed to a prefix
of its layers before its node (the rest reloading in order while the first layers compute), equals
its monolithic diffusers pipeline bitwise: prefix 0 (layer-wise pipelined loading), Lₑ′/2, Lₑ′, half
the layers and all of them (nothing to load)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from libs.dataplane.loader import Loader
from libs.models import families
from libs.protocol.ids import ModelKey
from libs.workflow.dag import DagNode
from libs.workflow.local import LocalRunner
from services.executor.runtime import ModelCache
from tests.unit.model_families import FAMILIES, NEGATIVE, Harness, harness
from tests.unit.test_img2img_inpaint import CASES as EDIT_CASES
from tests.unit.test_img2img_inpaint import edit_images
from tests.unit.test_img2img_inpaint import reference as edit_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PREFIXES: dict[str, Callable[[int, int], int]] = {
    "0": lambda keep, n: 0,
    "keep/2": lambda keep, n: keep // 2,
    "keep": lambda keep, n: keep,
    "half": lambda keep, n: n // 2,
    "all": lambda keep, n: n,
}


# Each workflow once, with the request its family's bitwise tests use (the first case naming it);
# the parallel true-CFG workflow with a negative prompt, as its own test asks the pipeline.
EXTRA = {"tiny-flux-cfg-parallel": {"negative_prompt": NEGATIVE, "true_cfg_scale": 2.5}}
# The img2img and inpainting workflows: their first case in test_img2img_inpaint.py, against its pipelines.
EDITS: dict[str, dict] = {}
for case in EDIT_CASES:
    EDITS.setdefault(case.values[0], case.values[1])  # type: ignore[arg-type]
WORKFLOWS = [
    pytest.param(f, name, id=name)
    for f in FAMILIES
    for name in [s.name for s in families.FAMILIES[f].module("workflows").workflows()]
]


def first_case(h: Harness, workflow: str) -> dict:
    if workflow in EXTRA:
        return dict(EXTRA[workflow])
    if workflow in EDITS:
        return dict(EDITS[workflow])
    return next(changes for w, changes, _ in h.cases if w == workflow)


_CACHES: dict[str, ModelCache] = {}


@pytest.fixture
def h(family: str, tmp_path_factory: pytest.TempPathFactory) -> Harness:
    return harness(family, tmp_path_factory)


@pytest.fixture(scope="module")
def loader() -> Iterator[Loader]:
    with Loader() as loader:  # no host tier: reloads read the checkpoints' suffixes from disk
        yield loader


def cache_for(h: Harness, loader: Loader) -> ModelCache:
    """One executor's model cache per family, kept across its workflows (as an executor's is)."""
    if h.family not in _CACHES:
        _CACHES[h.family] = ModelCache(h.root, "cpu", loader)
    return _CACHES[h.family]


def trimmer(
    cache: ModelCache, prefix: str, seen: list[tuple[ModelKey, int, int]]
) -> Callable[[DagNode], None]:
    """Before each node: its model trimmed to the prefix (once per model and run)."""
    done: set[ModelKey] = set()

    def on_node(node: DagNode) -> None:
        key = ModelKey(node.fn, node.model)
        if key not in cache.weights.models or key in done:
            return  # first use: loads from nothing, pipelined (prefix 0)
        done.add(key)
        n = len(cache.weights.models[key].slots)
        k = PREFIXES[prefix](cache.weights.policy.keep(key), n)
        cache.trim(node.fn, node.model, k)
        assert cache.weights.policy.resident(key) == k
        seen.append((key, k, n))

    return on_node


@pytest.mark.parametrize(("family", "workflow"), WORKFLOWS)
def test_each_workflow_over_the_weight_cache_at_every_prefix_equals_its_pipeline_bitwise(
    h: Harness, loader: Loader, workflow: str
) -> None:
    cache = cache_for(h, loader)
    changes = first_case(h, workflow)
    params = h.request(workflow, **changes)
    if workflow in EDITS:
        expected = edit_reference(h, workflow, params)
    else:
        expected = h.reference(workflow, params, **EXTRA.get(workflow, {}))
    runner = LocalRunner(h.root, classes=h.classes(), models=cache)
    images = {**h.images(workflow, params), **(edit_images(params) if workflow in EDITS else {})}
    trimmed: list[tuple[ModelKey, int, int]] = []
    for prefix in PREFIXES:
        seen: list[tuple[ModelKey, int, int]] = []
        out = runner.run(
            h.specs[workflow], params, images=images, loras=h.loras, on_node=trimmer(cache, prefix, seen)
        )
        assert np.array_equal(out["image"].numpy(), expected.image), (workflow, prefix, seen)
        trimmed += seen
    # The prefixes were real: some model ran with part of its layers, reloading the rest.
    assert any(0 < k < n for _, k, n in trimmed), trimmed
    assert all(cache.weights.policy.resident(key) == n for key, _, n in trimmed)
