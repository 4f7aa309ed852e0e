"""The executor's weight cache on real models: the layer lookup table, eviction under a device
budget (least recently used model first, its last layers first), a model that is executing never
losing a layer, and communication taking arena space back from cached weights without waiting."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from libs.dataplane.loader import Loader
from libs.dataplane.store import TensorStore
from libs.dataplane.transport import TcpTransport
from libs.dataplane.weights import ARENA, DEVICE, prefix_length
from libs.models import tiny_flux
from libs.protocol.ids import ModelKey
from services.executor.runtime import ModelCache
from services.executor.weights import PAGE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRANSFORMER = ModelKey("flux.transformer", "tiny-flux")
VAE = ModelKey("flux.vae_decode", "tiny-flux")
CLIP = ModelKey("flux.clip_encoder", "tiny-flux")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("weights")
    tiny_flux.build(out)
    return out


@pytest.fixture
def loader() -> Iterator[Loader]:
    with Loader() as loader:
        yield loader


def sizes(root: Path, loader: Loader) -> dict[ModelKey, int]:
    """Each model's bytes on the device, from an unbounded cache."""
    cache = ModelCache(root, "cpu", loader)
    for key in (TRANSFORMER, VAE, CLIP):
        cache.components(key.fn, key.model)
    return {key: cache.weights.models[key].nbytes for key in (TRANSFORMER, VAE, CLIP)}


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_the_layer_table_binds_every_tensor_into_its_layers_buffer_and_eviction_leaves_placeholders(
    root: Path, loader: Loader
) -> None:
    cache = ModelCache(root, "cpu", loader)
    comps, load = cache.components(TRANSFORMER.fn, TRANSFORMER.model)
    model = comps["transformer"]
    before = weights_of(model)
    vm = cache.weights.models[TRANSFORMER]
    assert load.frac == 1.0 and load.tier == "disk"
    assert [s.name for s in vm.slots][:2] == [layer.name for layer in vm.components[0].index.layers][:2]
    for slot in vm.slots:
        assert slot.where == DEVICE and (slot.storage is not None or not slot.tensors)
        for t in slot.tensors:
            bound = (t.owner._parameters if t.parameter else t.owner._buffers)[t.attr]
            lo = slot.storage.data_ptr()
            assert lo <= bound.data_ptr() < lo + slot.nbytes, slot.name
            assert bound.data_ptr() % PAGE == t.flat % PAGE  # the host layout's residues: same bits

    cache.trim(TRANSFORMER.fn, TRANSFORMER.model, 1)

    assert cache.cached()[TRANSFORMER][:2] == (1, len(vm.slots))
    evicted = vm.slots[-1].tensors[0]
    value = (evicted.owner._parameters if evicted.parameter else evicted.owner._buffers)[evicted.attr]
    assert value.stride() == (0,) * value.dim() and torch.isnan(value).all()
    assert vm.slots[-1].storage is None and vm.slots[0].storage is not None
    assert model.device == torch.device("cpu")  # ModelFns still ask a model for its device

    again, reload = cache.components(TRANSFORMER.fn, TRANSFORMER.model)
    assert again is comps and 0 < reload.frac < 1
    after = weights_of(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_the_first_load_profiles_each_layer_and_keeps_its_prefix(root: Path, loader: Loader) -> None:
    cache = ModelCache(root, "cpu", loader)
    cache.components(TRANSFORMER.fn, TRANSFORMER.model)  # loads, but never runs: no compute profile
    held = cache.acquire(TRANSFORMER.fn, TRANSFORMER.model)
    cache.release(held)
    assert (TRANSFORMER, "cpu") in cache.weights.profiles  # the first load ran with hooks timing

    profile = cache.weights.profiles[(TRANSFORMER, "cpu")]
    assert cache.weights.policy.keep(TRANSFORMER) == prefix_length(profile["disk"], profile["comp"])


def test_under_a_budget_the_least_recently_used_model_gives_up_its_last_layers_first(
    root: Path, loader: Loader
) -> None:
    size = sizes(root, loader)
    budget = size[TRANSFORMER] + size[VAE] // 2
    cache = ModelCache(root, "cpu", loader, budget=budget, keep=lambda key, sizes: 0)
    cache.components(TRANSFORMER.fn, TRANSFORMER.model)
    cache.components(VAE.fn, VAE.model)  # the transformer (older) makes room, top layers first

    n = len(cache.weights.models[TRANSFORMER].slots)
    kept = cache.cached()[TRANSFORMER][0]
    assert 0 < kept < n and cache.cached()[VAE][0] == len(cache.weights.models[VAE].slots)
    assert cache.weights.policy.used[DEVICE] <= budget
    # What is left of the transformer is its first layers: bound to real bytes, the rest not.
    slots = cache.weights.models[TRANSFORMER].slots
    assert all(s.storage is not None for s in slots[:kept] if s.tensors)
    assert all(s.storage is None for s in slots[kept:])


def test_a_model_that_is_executing_never_loses_a_layer(root: Path, loader: Loader) -> None:
    size = sizes(root, loader)
    cache = ModelCache(root, "cpu", loader, budget=size[TRANSFORMER], keep=lambda key, sizes: 0)
    running = cache.acquire(TRANSFORMER.fn, TRANSFORMER.model)  # pinned until released
    n = len(cache.weights.models[TRANSFORMER].slots)

    other = cache.acquire(VAE.fn, VAE.model)  # no room, and the transformer is pinned: over budget
    cache.release(other)
    assert cache.cached()[TRANSFORMER][0] == n, "a pinned model lost a layer"
    assert all(s.storage is not None for s in cache.weights.models[TRANSFORMER].slots if s.tensors)

    cache.release(running)  # unpinned: now the budget holds again
    assert cache.weights.policy.used[DEVICE] <= size[TRANSFORMER]


def test_a_communication_allocation_in_an_arena_full_of_weights_evicts_them_and_never_waits(
    root: Path, loader: Loader
) -> None:
    size = sizes(root, loader)
    arena = 1 << 21  # 2 MiB: the three models' ~1.4 MB of weights fill it
    transport = TcpTransport("127.0.0.1", 0, capacity=arena)
    try:
        store = TensorStore("exec", transport, alloc_timeout=0)  # a full arena fails at once
        cache = ModelCache(
            root, "cpu", loader, budget=PAGE, arena=transport.arena, arena_budget=arena,
            keep=lambda key, sizes: 0,
        )  # fmt: skip
        comps, _ = cache.components(TRANSFORMER.fn, TRANSFORMER.model)
        before = weights_of(comps["transformer"])
        for key in (VAE, CLIP):
            cache.components(key.fn, key.model)
        in_arena = cache.weights.policy.used[ARENA]
        assert in_arena > sum(size.values()) // 2, "the weights did not go to the idle arena"
        free = transport.arena.free_bytes

        big = torch.arange((free + (1 << 19)) // 4, dtype=torch.float32)  # more than is free
        meta = store.put("r/1/n/out", big, consumers=1, group="r/1")

        assert meta.nbytes == big.numel() * 4
        assert cache.weights.policy.used[ARENA] < in_arena, "no weights were reclaimed"
        assert cache.weights.evictions > 0
        # The evicted layers come back on the next use, with the same bits.
        again, load = cache.components(TRANSFORMER.fn, TRANSFORMER.model)
        after = weights_of(again["transformer"])
        assert all(torch.equal(before[n], after[n]) for n in before)
        store.discard("r/1/n/out")
    finally:
        transport.close()


def test_simulated_executors_make_the_same_cache_decisions_as_a_real_one(root: Path, loader: Loader) -> None:
    import asyncio

    from libs.protocol.messages import Dispatch
    from libs.sim.profile import Figure, ModelProfile, Profile
    from services.executor.sim import SimRunner, SimStore

    real_keys = {"dit": TRANSFORMER, "vae": VAE, "clip": CLIP, "t5": ModelKey("flux.t5_encoder", "tiny-flux")}
    unbounded = ModelCache(root, "cpu", loader)
    layer_bytes = {}
    for name, key in real_keys.items():
        unbounded.components(key.fn, key.model)
        layer_bytes[name] = unbounded.weights.models[key].sizes()
    budget = sum(layer_bytes["dit"]) + sum(layer_bytes["vae"]) // 2  # two models never fit together

    def fig(v: float) -> Figure:
        return Figure(v, "P", "measured from the tiny checkpoints")

    profile = Profile(
        name="tiny-flux",
        description="the tiny Flux models' layers as the real executor lays them out",
        device="cpu",
        gpu_memory_gb=fig(budget / 1e9),
        models={
            name: ModelProfile(fig(sum(b) / 1e9), fig(0.0), fig(0.001), layer_bytes=b)
            for name, b in layer_bytes.items()
        },
    )
    sim = SimRunner(profile, SimStore("sim-0", 1 << 20), time_scale=0.01)
    # Loads that cost nothing need no prefix: the real cache is told the same (keep = 0).
    real = ModelCache(root, "cpu", loader, budget=budget, keep=lambda key, sizes: 0)
    sequence = ["dit", "vae", "clip", "dit", "t5", "vae", "clip", "clip", "dit", "vae", "t5", "dit"]
    for i, name in enumerate(sequence):
        key = real_keys[name]
        real.components(key.fn, key.model)
        asyncio.run(sim.run(Dispatch("r", 1, f"n{i}", "t", "sim.denoiser", name, {}, [])))
        want = {
            ModelKey("sim.denoiser", n): real.cached()[k] for n, k in real_keys.items() if k in real.cached()
        }
        assert sim.cached() == want, (i, name)
    assert real.weights.evictions > 0


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_layers_reload_on_a_side_stream_and_the_image_keeps_its_bits(
    root: Path, loader: Loader
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none on this machine)")
    from libs.models.flux_workflows import tiny_flux
    from libs.workflow.local import LocalRunner

    cache = ModelCache(root, "cuda", loader)
    runner = LocalRunner(root, models=cache, device="cuda")
    params = {"prompt": "a lighthouse", "seed": 5, "num_inference_steps": 3, "max_sequence_length": 32}
    reference = runner.run(tiny_flux(), params)["image"]  # every layer loaded, then resident
    vm = cache.weights.models[TRANSFORMER]
    assert all(s.storage is None or s.storage.is_cuda for s in vm.slots)
    for resident in (0, len(vm.slots) // 2):
        for key in list(cache.weights.models):
            cache.trim(key.fn, key.model, resident)
        image = runner.run(tiny_flux(), params)["image"]
        assert torch.equal(image, reference), resident
        assert any(s.event is not None for s in vm.slots)  # copies ran on the side stream, with events


def test_a_layer_is_never_bound_to_memory_on_another_device_than_its_model(
    root: Path, loader: Loader
) -> None:
    """The weight cache of a CUDA model once fell back to the host arena under pressure and bound
    its layers to CPU memory. Binding now refuses bytes on another device (the model is unchanged),
    and an arena on another device than the weights' holds no cached weights at all."""
    from libs.dataplane.arena import HeapArena
    from services.executor.layers import WrongDeviceError
    from services.executor.weights import WeightCache

    cache = ModelCache(root, "cpu", loader)
    comps, _ = cache.components(TRANSFORMER.fn, TRANSFORMER.model)
    vm = cache.weights.models[TRANSFORMER]
    i = next(i for i, s in enumerate(vm.slots) if s.tensors)
    before = weights_of(comps["transformer"])
    with pytest.raises(WrongDeviceError, match="refusing to bind"):
        vm.bind(i, torch.empty(vm.slots[i].nbytes, dtype=torch.uint8, device="meta"))
    after = weights_of(comps["transformer"])
    assert all(torch.equal(before[n], after[n]) for n in before)

    arena = HeapArena(1 << 20)
    try:
        elsewhere = WeightCache("meta", 1 << 20, loader=loader, arena=arena, arena_budget=1 << 19)
        assert elsewhere.arena is None and elsewhere.policy.budgets[ARENA] == 0
        same = WeightCache("cpu", 1 << 20, loader=loader, arena=arena, arena_budget=1 << 19)
        assert same.arena is arena and same.policy.budgets[ARENA] == 1 << 19
    finally:
        arena.close()


class _Slow:
    """A loader whose loads start late: a layer read before its copy lands reads a placeholder."""

    def __init__(self, base: Loader, delay: float) -> None:
        self._base = base
        self._delay = delay

    def load(self, *args: object, **kwargs: object) -> object:
        import time

        time.sleep(self._delay)
        return self._base.load(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._base, name)


def test_a_layer_of_buffers_read_outside_any_forward_is_loaded_before_the_model_runs(
    tmp_path: Path, loader: Loader
) -> None:
    """AutoencoderKLFlux2's pipeline reads ``vae.bn.running_mean``/``running_var`` itself, before
    ``decode``: no forward hook waits there, and with ``bn`` (its last layer) evicted it read NaN
    placeholders (a black image). A layer whose module holds buffers only is loaded before the
    model runs; the other layers still load behind the forward."""
    from diffusers.configuration_utils import ConfigMixin, register_to_config
    from diffusers.models.modeling_utils import ModelMixin

    from libs.models.common import load_component
    from services.executor.weights import WeightCache

    class Stats(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, channels: int = 4, depth: int = 3) -> None:
            super().__init__()
            self.conv_in = torch.nn.Conv2d(channels, channels, 3, padding=1)
            self.blocks = torch.nn.ModuleList(torch.nn.Conv2d(channels, channels, 1) for _ in range(depth))
            self.bn = torch.nn.BatchNorm2d(channels, affine=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.conv_in(x)
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    source = Stats().eval()
    source.bn.running_mean.copy_(torch.randn(4))
    source.bn.running_var.copy_(torch.rand(4) + 0.5)
    source.save_pretrained(tmp_path / "stats")
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        expected = source(x) * source.bn.running_var.sqrt().view(1, -1, 1, 1) + source.bn.running_mean.view(
            1, -1, 1, 1
        )

    model = load_component(Stats, str(tmp_path / "stats"), None, "cpu", loader)
    cache = WeightCache("cpu", 0, loader=loader)
    key = ModelKey("stats", "tiny")
    vm = cache.add(key, {"model": model}, loader=_Slow(loader, 0.3))
    assert [vm.slots[i].name for i in vm.direct] == ["bn"]  # the parameters' layers stay pipelined
    for resident in (len(vm.slots), 0, 2):
        cache.trim(key, resident)
        job, report = cache.begin(key)
        try:
            with torch.no_grad():
                mean, var = model.bn.running_mean.view(1, -1, 1, 1), model.bn.running_var.view(1, -1, 1, 1)
                assert torch.equal(mean.flatten(), source.bn.running_mean), resident
                out = model(x) * var.sqrt() + mean
        finally:
            cache.end(key, job, report)
        assert torch.equal(out, expected), resident
