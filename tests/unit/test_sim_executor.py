"""Simulated executors: the metadata-only store and the runner that replays profiled times."""

from __future__ import annotations

import pytest

from libs.protocol.ids import ModelKey, NodeRef
from libs.protocol.messages import Dispatch, OutputPlan
from services.executor.outcome import NodeError
from services.executor.sim import SimRunner, SimStore
from tests.support.toyprofile import PROFILE

NODE = NodeRef("r", 1, "n")


def test_discard_frees_a_simulated_tensor_whatever_its_readers() -> None:
    store = SimStore("sim-0", 1 << 16)
    store.put("r/1/n/a", 4096, consumers=3, group="r/1")
    assert store.release("r/1/n/a") is False
    assert store.discard("r/1/n/a") is True
    assert store.discard("r/1/n/a") is False
    assert store.stats()["used"] == 0 and store.stats()["tensors"] == 0


async def test_a_simulated_node_stores_its_outputs_by_tensor_ref_and_reports_its_model() -> None:
    store = SimStore("sim-0", 1 << 16)
    runner = SimRunner(PROFILE, store)
    d = Dispatch("r", 1, "n", "t", "toy.fn", "m", {}, [OutputPlan("a", 2), OutputPlan("b", 1)])
    out = await runner.run(d)
    assert [m.tensor_id for m in out.outputs.values()] == ["r/1/n/a", "r/1/n/b"]
    assert runner.resident() == [ModelKey("toy.fn", "m")]
    assert store.release_group(NODE.attempt_ref.encode()) == 2


async def test_a_simulated_output_that_does_not_fit_discards_the_ones_already_stored() -> None:
    store = SimStore("sim-0", 8192)  # room for one 4 KiB output of the two
    runner = SimRunner(PROFILE, store)
    d = Dispatch("r", 1, "n", "t", "toy.fn", "m", {}, [OutputPlan("a", 1), OutputPlan("b", 1)])
    store.put("other", 4096, consumers=1, group="r/0")
    with pytest.raises(NodeError, match="storing b") as e:
        await runner.run(d)
    assert e.value.retryable
    assert store.stats()["tensors"] == 1 and store.stats()["used"] == 4096
