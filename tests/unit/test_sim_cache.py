"""Simulated executors cache models layer by layer with the real executors' policy
(:class:`libs.dataplane.weights.CachePolicy`): LRU models give up their top layers first, a partly
resident model is charged only the load its compute cannot hide, and communication takes the
arena's cached weights back."""

from __future__ import annotations

import itertools

import pytest

from libs.dataplane.weights import pipelined_seconds
from libs.protocol.ids import ModelKey
from libs.protocol.messages import Dispatch, NodeTiming
from libs.sim.profile import Figure, ModelProfile, Profile
from services.executor.outcome import NodeError
from services.executor.sim import SimRunner, SimStore

FN = "toy.fn"
LAYERS = 4
LOAD_S, EXEC_S = 0.12, 0.084  # per layer 0.03 s to load, 0.021 s to compute: Lₑ′ = 2 (Eq. 2: 1.9)
LOAD, COMP = [LOAD_S / LAYERS] * LAYERS, [EXEC_S / LAYERS] * LAYERS
COLD = pipelined_seconds(LOAD, COMP, 0) - sum(COMP)


def fig(value: float) -> Figure:
    return Figure(value, "P", "test")


def model(size_gb: float, load_s: float = LOAD_S, exec_s: float = EXEC_S, layers: int = LAYERS):
    return ModelProfile(fig(size_gb), fig(load_s), fig(exec_s), output_bytes=4096, layers=layers)


def profile(gpu_gb: float, models: dict[str, ModelProfile], arena_weights: float = 0.0) -> Profile:
    return Profile(
        name="cache",
        description="models of a few uniform layers",
        device="sim",
        gpu_memory_gb=fig(gpu_gb),
        models=models,
        arena_weights=arena_weights,
    )


def key(name: str) -> ModelKey:
    return ModelKey(FN, name)


NODES = itertools.count()


async def node(runner: SimRunner, name: str) -> NodeTiming:
    out = await runner.run(Dispatch("r", 1, f"n{next(NODES)}", "t", FN, name, {}, []))
    return out.timing


def exposed_load(t: NodeTiming, exec_s: float = EXEC_S) -> float:
    """The load a node reported, in profile seconds: timings share one measured stretch factor."""
    return t.load_s / t.exec_s * exec_s


def gb(layers: int) -> int:
    return layers * 10**9


async def test_lru_models_give_up_top_layers_and_a_prefix_hides_part_of_the_reload() -> None:
    # 7 GB holds a and b but for one layer; layers are 1 GB
    runner = SimRunner(profile(7, {m: model(4) for m in "abc"}), SimStore("sim-0", 1 << 16), 1e-3)
    evicted: list[tuple[str, int]] = []
    original = runner._evicted
    runner._evicted = lambda ev: (evicted.append((ev.key.model, ev.layer)), original(ev))

    cold = await node(runner, "a")
    assert exposed_load(cold) == pytest.approx(COLD) and COLD > 0
    assert (cold.load_tier, cold.load_frac) == ("host", 1.0)
    assert runner.policy.keep(key("a")) == 2
    await node(runner, "b")
    assert evicted == [("a", 3)]
    await node(runner, "c")  # phase 1: a then b down to their keep (2); phase 2: a's prefix
    assert evicted == [("a", 3), ("a", 2), ("b", 3), ("b", 2), ("a", 1)]
    assert runner.cached() == {
        key("a"): (1, 4, gb(1), gb(4)),
        key("b"): (2, 4, gb(2), gb(4)),
        key("c"): (4, 4, gb(4), gb(4)),
    }
    assert runner.resident() == [key("c")]

    evicted.clear()
    warm = await node(runner, "a")  # one layer resident: part of the reload hides behind it
    partial = pipelined_seconds(LOAD, COMP, 1) - sum(COMP)
    assert exposed_load(warm) == pytest.approx(partial)
    assert 0 < partial < COLD
    assert (warm.load_tier, warm.load_frac) == ("host", 0.75)
    assert evicted == [("c", 3), ("c", 2), ("b", 1)]  # b sits at its keep, so c goes first
    assert runner.cached()[key("a")] == (4, 4, gb(4), gb(4))

    hot = await node(runner, "a")
    assert (hot.load_s, hot.load_tier, hot.load_frac) == (0.0, "", 0.0)

    hidden = await node(runner, "c")  # back to 4 layers from its keep (2): loading fully hidden
    assert hidden.load_s == 0.0 and (hidden.load_tier, hidden.load_frac) == ("host", 0.5)


async def test_uneven_sizes_sum_to_the_model_and_a_model_larger_than_the_gpu_fails() -> None:
    models = {"odd": model(1e-9 * 10, layers=3), "huge": model(9)}
    runner = SimRunner(profile(8, models), SimStore("sim-0", 1 << 16), 1e-3)
    await node(runner, "odd")
    assert runner.policy.sizes(key("odd")) == (4, 3, 3)
    with pytest.raises(NodeError, match="more than the 8"):
        await node(runner, "huge")
    assert key("huge") not in runner.cached()


@pytest.mark.timeout(10)
async def test_a_put_into_an_arena_full_of_cached_weights_takes_them_back() -> None:
    # the device region holds 4000 bytes (model a); b spills into the arena's share (half of it)
    models = {"a": model(4e-6, layers=2), "b": model(4e-6, layers=2)}
    store = SimStore("sim-0", 1 << 16)
    runner = SimRunner(profile(4e-6, models, arena_weights=0.5), store, 1e-3)
    await node(runner, "a")
    await node(runner, "b")
    assert runner.policy.region(key("b"), 0) == "arena"
    assert store.stats()["weight_blocks"] == 2
    assert runner.cached()[key("b")] == (2, 2, 4000, 4000)

    meta = store.put("r/1/x/out", 1 << 16, consumers=1, group="r/1")  # the whole arena
    assert meta.offset == 0
    assert store.stats()["weight_blocks"] == 0
    assert runner.cached() == {key("a"): (2, 2, 4000, 4000)}  # device layers stay
    assert runner.policy.used == {"device": 4000, "arena": 0}

    store.release("r/1/x/out")
    again = await node(runner, "b")  # reloads into the arena
    assert again.load_frac == 1.0 and store.stats()["weight_blocks"] == 2


async def test_a_put_that_no_cached_weight_could_make_room_for_still_fails() -> None:
    from libs.dataplane.errors import ArenaFullError

    store = SimStore("sim-0", 1 << 16)
    SimRunner(profile(1, {"a": model(0.5)}, arena_weights=0.5), store, 1e-3)
    store.put("held", 1 << 15, consumers=1, group="g")
    with pytest.raises(ArenaFullError):
        store.put("big", 1 << 16, consumers=1, group="g")
    assert store.stats()["tensors"] == 1
