"""The executor's node runner: bind inputs, execute, store outputs, and give back whatever a
failed run acquired (pulled copies, half-stored outputs, callback deliveries)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from libs.dataplane.store import TensorStore
from libs.dataplane.transport import TcpTransport
from libs.protocol.ids import ModelKey, NodeRef
from libs.protocol.messages import ConstInput, Dispatch, OutputPlan, PendingInput, TensorInput
from libs.protocol.tensor_meta import TensorMeta
from libs.workflow.modelfn import ModelFn
from services.executor.outcome import NodeError
from services.executor.runtime import ModelCache, NodeRunner
from tests.support.toyfns import Crash, Pair

ARENA = 1 << 20
NODE = NodeRef("r", 1, "n")


class ToyModels(ModelCache):
    """The model cache over the toy ModelFns (they are not installed as entry points)."""

    def fn(self, name: str) -> ModelFn:
        self._fns.setdefault(name, {c.fn_name: c for c in (Pair, Crash)}[name]())
        return self._fns[name]


@pytest.fixture
def stores() -> Iterator[tuple[TensorStore, TensorStore]]:
    """The runner's store (``exec``) and a peer's (``peer``) it pulls inputs from."""
    mine, theirs = TcpTransport("127.0.0.1", 0, capacity=ARENA), TcpTransport("127.0.0.1", 0, capacity=ARENA)
    try:
        yield TensorStore("exec", mine, alloc_timeout=0), TensorStore("peer", theirs, alloc_timeout=0)
    finally:
        mine.close()
        theirs.close()


@pytest.fixture
def runner(stores: tuple[TensorStore, TensorStore], tmp_path: Path) -> Iterator[NodeRunner]:
    r = NodeRunner(stores[0], ToyModels(tmp_path, "cpu"), "cpu", callback_timeout_s=10)
    yield r
    r.close()


def dispatch(fn: str, inputs: dict, outputs: list[OutputPlan]) -> Dispatch:
    return Dispatch(NODE.request_id, NODE.attempt, NODE.node_id, "tenant", fn, "m", inputs, outputs)


def pair(x: TensorMeta, mode: str, second_sink: str = "") -> Dispatch:
    return dispatch(
        "toy.pair",
        {"x": TensorInput(x), "mode": ConstInput(mode)},
        [OutputPlan("first", consumers=2), OutputPlan("second", consumers=1, sink=second_sink)],
    )


def held_by_node(store: TensorStore) -> list[str]:
    return [t for t in store._entries if t.startswith(NODE.encode() + "/")]


def test_a_node_pulls_its_inputs_stores_its_outputs_and_frees_the_pulled_copies(runner, stores) -> None:
    mine, peer = stores
    x = peer.put("r/1/p/x", torch.arange(6, dtype=torch.float32), consumers=1, group="r/1")
    out = runner.run_sync(pair(x, "ok", second_sink="img.png"))
    first, second = out.outputs["first"], out.outputs["second"]
    assert [m.tensor_id for m in first] == ["r/1/n/first#0", "r/1/n/first#1"]
    assert second.tensor_id == "r/1/n/second" and mine.refcount("r/1/n/second") == 1
    assert mine.refcount("r/1/n/first#0") == 2
    assert out.pngs["second"].height == 2 and out.reads == [x] and out.bytes_in == x.nbytes
    held = sum(mine.transport.arena.block_size(m.offset) for m in [*first, second])
    assert mine.stats()["used"] == held and mine.stats()["copies"] == 0  # the pulled x is freed
    assert mine._groups == {"r/1": set(held_by_node(mine))}
    assert runner.resident() == [ModelKey("toy.pair", "m")]


def test_a_retried_node_replaces_its_earlier_outputs(runner, stores) -> None:
    mine, peer = stores
    x = peer.put("r/1/p/x", torch.arange(6, dtype=torch.float32), consumers=1, group="r/1")
    runner.run_sync(pair(x, "ok"))
    used = mine.stats()["used"]
    runner.run_sync(pair(x, "ok"))
    assert mine.stats()["used"] == used and len(held_by_node(mine)) == 3


def test_an_execute_that_raises_frees_pulled_copies_and_forgets_callback_deliveries(runner, stores) -> None:
    mine, peer = stores
    local = mine.put("r/1/q/x", torch.ones(8), consumers=1, group="r/1")
    remote = peer.put("r/1/p/y", torch.ones(300), consumers=1, group="r/1")
    later = peer.put("r/1/p/z", torch.ones(500), consumers=1, group="r/1")
    before = mine.stats()
    runner.callbacks.deliver(NODE.callback("w"), remote)  # delivered, never asked for
    inputs = {"x": TensorInput(local), "y": TensorInput(remote), "z": TensorInput(later)}
    with pytest.raises(NodeError, match="toy.crash.execute raised RuntimeError: boom") as e:
        runner.run_sync(dispatch("toy.crash", inputs, [OutputPlan("out", 1)]))
    assert not e.value.retryable
    assert mine.stats() == before and held_by_node(mine) == []  # copies of y and z gone, x untouched
    assert mine.refcount("r/1/q/x") == 1 and peer.refcount("r/1/p/y") == 1  # a failed node reads nothing
    assert len(runner.callbacks) == 0


def test_a_failed_pull_frees_the_inputs_pulled_before_it(runner, stores) -> None:
    mine, peer = stores
    remote = peer.put("r/1/p/x", torch.ones(300), consumers=1, group="r/1")
    gone = mine.put("r/1/q/y", torch.ones(8), consumers=1, group="r/1")
    mine.release("r/1/q/y")
    before = mine.stats()
    d = dispatch("toy.crash", {"x": TensorInput(remote), "y": TensorInput(gone)}, [OutputPlan("out", 1)])
    with pytest.raises(NodeError, match="input r/1/q/y: tensor 'r/1/q/y' is not held") as e:
        runner.run_sync(d)
    assert not e.value.retryable and not e.value.unreachable
    assert mine.stats() == before


def test_a_callback_wait_cancelled_by_a_release_gives_back_what_the_node_pulled(runner, stores) -> None:
    mine, peer = stores
    x = peer.put("r/1/p/x", torch.ones(300), consumers=1, group="r/1")
    y = peer.put("r/1/p/y", torch.ones(500), consumers=1, group="r/1")
    before = mine.stats()
    inputs = {"x": TensorInput(x), "y": TensorInput(y), "z": PendingInput("c", "out")}
    failed: list[NodeError] = []

    def run() -> None:
        try:
            runner.run_sync(dispatch("toy.crash", inputs, [OutputPlan("out", 1)]))
        except NodeError as e:
            failed.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 10
    while not runner.callbacks._waiting and time.monotonic() < deadline:
        threading.Event().wait(0.001)
    assert mine.stats()["copies"] == 2  # x and y are pulled, execute waits for z
    runner.callbacks.cancel(NODE.attempt_ref)
    worker.join(10)
    assert len(failed) == 1 and "callback input r/1/n:z cancelled" in str(failed[0])
    assert mine.stats() == before and len(runner.callbacks) == 0


@pytest.mark.parametrize(
    ("mode", "sink", "error", "retryable"),
    [
        ("huge", "", "storing second: arena cannot fit", False),
        ("none", "", "returned no tensor", False),
        ("float", "img.png", "must be uint8", False),  # stored, then its PNG fails
    ],
)
def test_an_output_that_fails_discards_the_outputs_already_stored(
    runner, stores, mode: str, sink: str, error: str, retryable: bool
) -> None:
    mine, peer = stores
    x = peer.put("r/1/p/x", torch.arange(6, dtype=torch.float32), consumers=1, group="r/1")
    before = mine.stats()
    with pytest.raises(NodeError, match=error) as e:
        runner.run_sync(pair(x, mode, second_sink=sink))
    assert e.value.retryable is retryable
    assert held_by_node(mine) == [] and mine.stats() == before
    assert mine._groups == {}


def test_the_model_cache_loads_each_model_once_for_its_device(tmp_path: Path) -> None:
    models = ToyModels(tmp_path, "cpu")
    comps, first = models.components("toy.pair", "m")
    assert comps["device"] == "cpu" and comps["path"] == "m"
    assert first.tier == "disk"  # no loader: loaded by the ModelFn's own means, counted as disk
    again, load = models.components("toy.pair", "m")
    assert again is comps and load.seconds == 0.0 and load.tier == ""
    models.components("toy.crash", "m")
    assert models.resident() == [ModelKey("toy.crash", "m"), ModelKey("toy.pair", "m")]
