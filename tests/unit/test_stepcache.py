"""Step caching (:mod:`libs.models.stepcache`) on every DiT family that diffusers' First-Block-Cache
can hook: off, the images are today's; on, they equal the monolithic pipeline with the same hook
enabled, bit for bit, although every step's node enables the hook afresh and receives the state
of the step before as a tensor input (as it would on another executor).

Flux's ControlNet pipeline calls the transformer without a cache context, which the hook needs:
there the reference wraps the transformer's forward in ``cache_context("cond")``, the context the
node uses. Four DiT families do not offer caching, because diffusers' First-Block-Cache cannot run on them:
Sana's blocks are not registered with diffusers' hooks; on Flux.2 Klein the head block's output is a
pair and the single-stream tail's a tensor (``Flux2KleinPipeline`` with the hook enabled raises a
``TypeError`` in ``first_block_cache.py``); SD3's last joint block returns no text stream
(``context_pre_only``), which the tail hook subtracts (``TypeError`` again); Z-Image's blocks take
their input as ``x``, not the ``hidden_states`` the hook reads (``ValueError``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from libs.models import families, stepcache
from libs.workflow.local import LocalRunner
from tests.unit.model_families import Harness, harness

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

# (family, workflow, whether its pipeline names a cache context itself)
CACHED = [
    ("flux", "tiny-flux", True),
    ("flux", "tiny-flux-controlnet-lora", False),  # FluxControlNetPipeline names no context
    ("qwenimage", "tiny-qwenimage", True),
    ("qwenimage", "tiny-qwenimage-edit", True),
]


def _pipelines(obj: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """The diffusers pipelines a harness keeps (in dicts and helper objects), each once."""
    from diffusers import DiffusionPipeline

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, DiffusionPipeline):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _pipelines(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module | type):
        for v in vars(obj).values():
            yield from _pipelines(v, seen)


@contextmanager
def hooked(h: Harness, threshold: float, *, name_context: bool) -> Iterator[None]:
    """The harness's pipelines with First-Block-Cache enabled on their transformers (and, where
    the pipeline names none, the forward under ``cache_context("cond")``)."""
    from diffusers.hooks import FirstBlockCacheConfig

    transformers = {id(p.transformer): p.transformer for p in _pipelines(h)}
    assert transformers, "the harness made no pipeline yet"
    patched = []
    for t in transformers.values():
        t.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        if not name_context:
            forward = t.forward

            def in_context(*args: Any, _t: Any = t, _forward: Any = forward, **kwargs: Any) -> Any:
                with _t.cache_context("cond"):
                    return _forward(*args, **kwargs)

            t.forward = in_context
            patched.append(t)
    try:
        yield
    finally:
        for t in transformers.values():
            t.disable_cache()
        for t in patched:
            del t.forward


@pytest.mark.parametrize(("family", "workflow", "names_context"), CACHED, ids=[w for _, w, _ in CACHED])
def test_a_cached_request_equals_the_pipeline_with_the_same_hook(
    family: str, workflow: str, names_context: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    h = harness(family, tmp_path_factory)
    plain = h.request(workflow, num_inference_steps=5)
    uncached = h.run(h.runner, workflow, plain)
    assert uncached.same(h.reference(workflow, plain)), "caching off: today's image"

    images = {}
    for threshold in (0.3, 1.0):
        params = {**plain, "cache": "first_block", "cache_threshold": threshold}
        got = h.run(h.runner, workflow, params)
        with hooked(h, threshold, name_context=names_context):
            want = h.reference(workflow, plain)
        assert got.same(want), f"threshold {threshold}"
        images[threshold] = got.image
    assert not np.array_equal(images[1.0], uncached.image), "a threshold of 1 skips steps"
    # the warm node keeps its hooks between cached calls; an uncached call after them is today's
    assert h.run(h.runner, workflow, plain).same(uncached)


def test_the_state_travels_between_steps_and_an_executor_without_it_would_differ(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Each step's node gets the previous step's state as its input: a node that drops it (a step
    run where the state was lost) computes every block, as if uncached."""
    from libs.models.flux import FluxTransformer

    h = harness("flux", tmp_path_factory)
    seen: list[int] = []

    class Forgetful(FluxTransformer):
        def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
            seen.append(len(inputs["cache_state"]))
            return super().execute(components, **{**inputs, "cache_state": []})

    params = h.request("tiny-flux", num_inference_steps=5, cache="first_block", cache_threshold=1.0)
    forgetful = LocalRunner(h.root, classes=h.classes(**{"flux.transformer": Forgetful}))
    without = h.run(forgetful, "tiny-flux", params)
    uncached = h.run(h.runner, "tiny-flux", {**params, "cache": ""})
    cached = h.run(h.runner, "tiny-flux", params)

    assert seen[0] == 0 and all(n > 1 for n in seen[1:]), "step 0 starts fresh, then a header and tensors"
    assert without.same(uncached) and not cached.same(uncached)


def test_the_state_round_trips_and_bad_state_is_refused() -> None:
    from diffusers import FluxTransformer2DModel
    from diffusers.hooks import FirstBlockCacheConfig

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=4,
        num_attention_heads=2,
        joint_attention_dim=8,
        pooled_projection_dim=8,
        axes_dims_rope=[2, 2, 0],
    ).eval()
    model.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    try:
        args = dict(
            hidden_states=torch.randn(1, 4, 8),
            encoder_hidden_states=torch.randn(1, 3, 8),
            pooled_projections=torch.randn(1, 8),
            timestep=torch.tensor([0.5]),
            img_ids=torch.zeros(4, 3),
            txt_ids=torch.zeros(3, 3),
            return_dict=False,
        )
        with torch.no_grad(), model.cache_context("cond"):
            model(**args)
        state = stepcache.export_state(model)
        stepcache.import_state(model, state, "cpu")
        again = stepcache.export_state(model)
    finally:
        model.disable_cache()

    assert state[0].dtype == torch.uint8 and len(state) == len(again) > 1
    assert all(torch.equal(a, b) for a, b in zip(state, again, strict=True))
    model.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    try:
        with pytest.raises(ValueError, match="header"):
            stepcache.import_state(model, [torch.tensor([255, 0], dtype=torch.uint8)], "cpu")
        with pytest.raises(ValueError, match="state managers"):
            stepcache.import_state(model, [torch.frombuffer(bytearray(b"[]"), dtype=torch.uint8)], "cpu")
    finally:
        model.disable_cache()
    with pytest.raises(ValueError, match="cache must be one of"):
        stepcache.cache_spec({"cache": "teacache"})
    assert stepcache.cache_spec({"cache": ""}) is None and stepcache.cache_spec({}) is None


def test_every_dit_generation_workflow_offers_caching_and_sana_does_not() -> None:
    offering = {w.name for w in families.workflows() if "cache" in w.params}
    for _, workflow, _ in CACHED:
        assert workflow in offering, workflow
    assert not any(
        w.startswith(("tiny-sana", "tiny-sd15", "tiny-flux2", "tiny-sd3", "tiny-zimage")) for w in offering
    )
    assert "tiny-flux-cfg-parallel" not in offering  # two transformer nodes a step: not offered
    for name in offering:
        spec = next(w for w in families.workflows() if w.name == name)
        assert spec.params["cache"].default == "" and spec.params["cache_threshold"].default == 0.05
