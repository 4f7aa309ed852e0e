"""Device memory as the weight cache counts it (services/executor/weights.py): weights and
activations share a pool whose accounting is the cache's own, so the budget does not shrink as
layers are evicted (freed blocks stay reserved in a caching allocator, which the cache never asks);
each model runs with room left for its profiled activations (others' layers evicted to make it);
and a VAE decode whose activations do not fit decodes in tiles. The pool here is a stand-in for a
GPU's (the CPU has no allocator to profile): the activations are recorded as the runner records
them from CUDA's peak-allocated counter."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from libs.dataplane.loader import Loader
from libs.dataplane.store import TensorStore
from libs.dataplane.transport import TcpTransport
from libs.dataplane.weights import DEVICE
from libs.protocol.ids import ModelKey, NodeRef
from libs.protocol.messages import ConstInput, Dispatch, OutputPlan, TensorInput
from services.executor.runtime import ModelCache, NodeRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

T = ModelKey("flux.transformer", "tiny-flux")
VAE = ModelKey("flux.vae_decode", "tiny-flux")
CLIP = ModelKey("flux.clip_encoder", "tiny-flux")
KEYS = (T, VAE, CLIP)


@pytest.fixture(scope="module")
def root(tiny_models: Path) -> Path:
    return tiny_models


@pytest.fixture(scope="module")
def sizes(root: Path) -> dict[ModelKey, int]:
    with Loader() as loader:
        cache = ModelCache(root, "cpu", loader)
        for key in KEYS:
            cache.components(key.fn, key.model)
        return {key: cache.weights.models[key].nbytes for key in KEYS}


def test_each_model_runs_with_room_for_its_activations_and_the_budget_does_not_shrink(root, loader, sizes):
    pool = sum(sizes.values()) + 4096
    cache = ModelCache(root, "cpu", loader, pool=pool)
    weights = cache.weights
    weights.default_headroom = 0  # nothing profiled yet: every model fits beside the others
    for key in KEYS:
        cache.components(key.fn, key.model)
    assert weights.policy.used[DEVICE] == sum(sizes.values()) <= pool

    # The transformer's run turns out to need room for nearly everything else's weights.
    weights.record_activation(T, sizes[VAE] + sizes[CLIP])
    held = cache.acquire(T.fn, T.model)
    assert weights.policy.used[DEVICE] + weights.headroom(T) <= pool
    assert weights.snapshot()[T][0] == weights.snapshot()[T][1]  # its own layers all stay
    cache.release(held)
    weights.record_activation(T, 10)  # a smaller run does not lower what the largest needed
    assert weights.headroom(T) == sizes[VAE] + sizes[CLIP]

    # Many rounds of eviction and reloading: the room each model gets is the same every time.
    rng = random.Random(7)
    weights.record_activation(VAE, sizes[T] // 3)
    seen: dict[ModelKey, set[int]] = {k: set() for k in KEYS}
    for _ in range(12):
        key = rng.choice(KEYS)
        held = cache.acquire(key.fn, key.model)
        seen[key].add(weights.policy.budgets[DEVICE])
        if sizes[key] + weights.headroom(key) <= pool:
            assert weights.policy.used[DEVICE] + weights.headroom(key) <= pool
        cache.release(held)
        assert weights.policy.used[DEVICE] <= pool
    assert all(len(budgets) <= 1 for budgets in seen.values()), seen
    assert weights.evictions > 0


def test_a_model_larger_than_its_room_still_runs_and_everything_else_makes_way(root, loader, sizes):
    pool = sizes[T] + sizes[CLIP]
    cache = ModelCache(root, "cpu", loader, pool=pool)
    cache.weights.default_headroom = 0
    cache.components(CLIP.fn, CLIP.model)
    cache.weights.record_activation(T, pool)  # weights + activations > pool
    comps, _ = cache.components(T.fn, T.model)
    assert CLIP not in cache.weights.snapshot()  # evicted whole for it
    assert cache.weights.snapshot()[T][0] > 0


def _decode(runner: NodeRunner, store: TensorStore, latents: torch.Tensor, n: int) -> torch.Tensor:
    node = NodeRef("r", 1, f"decode{n}")
    meta = store.put(f"r/1/in{n}/latents", latents, consumers=1, group="r/1")
    inputs = {"latents": TensorInput(meta), "height": ConstInput(64), "width": ConstInput(64)}
    d = Dispatch(
        node.request_id,
        node.attempt,
        node.node_id,
        "tenant",
        VAE.fn,
        VAE.model,
        inputs,
        [OutputPlan("image", 1)],
    )
    out = runner.run_sync(d)
    image = store.open(out.outputs["image"]).tensor.clone()
    store.release(out.outputs["image"].tensor_id)
    return image


def test_a_vae_decode_whose_activations_do_not_fit_decodes_in_tiles(root, loader, sizes):
    transport = TcpTransport("127.0.0.1", 0, capacity=4 << 20)
    cache = ModelCache(root, "cpu", loader, pool=sizes[VAE] + (1 << 30))
    runner = NodeRunner(TensorStore("exec", transport, alloc_timeout=0), cache, "cpu")
    try:
        g = torch.Generator().manual_seed(0)
        latents = torch.randn(1, 16 * 16, 16, generator=g)  # packed: a 64x64 image of the tiny VAE
        whole = _decode(runner, runner.store, latents, 0)  # fits: decoded whole

        cache.weights.record_activation(VAE, 2 << 30)  # its profile: more than the pool has left
        tiled = _decode(runner, runner.store, latents, 1)
        vae = cache.acquire(VAE.fn, VAE.model)
        try:
            assert not vae.components["vae"].use_tiling  # switched on for that run only
            vae.components["vae"].enable_tiling()
            fn = cache.fn(VAE.fn)
            with torch.no_grad():
                expected = fn.execute(vae.components, latents=latents, height=64, width=64)["image"]
            vae.components["vae"].disable_tiling()
        finally:
            cache.release(vae)
        assert torch.equal(tiled, expected)  # diffusers' own tiled decode
        assert not torch.equal(tiled, whole) and tiled.shape == whole.shape == (64, 64, 3)
    finally:
        runner.close()
        transport.close()
