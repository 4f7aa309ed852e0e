"""Layer-granular caching seen by the control plane (paper "ServerlessT2I", arXiv 2607.26566, §5.1):
executors report how much of each model is on the device, placement prefers the executor holding
most of it, the charge counts only the part to load, and partial loads train whole-model estimates."""

from __future__ import annotations

import logging
import math

import msgspec
import pytest

from libs.protocol.ids import ModelKey, NodeRef
from libs.protocol.messages import (
    ExecutorHeartbeat,
    ImageRequest,
    NodeComplete,
    NodeTiming,
    encode,
    sched_decoder,
)
from services.scheduler.core.effects import ChargeVTime, SendDispatch
from services.scheduler.core.estimates import Estimator
from services.scheduler.core.executors import cached_fraction
from services.scheduler.core.policy import get_policy
from services.scheduler.core.scheduling import SchedulerCore
from services.scheduler.core.snapshot import ExecutorInfo, ReadyNode, best_fit, charge_for
from tests.unit.test_fair_policy import chain, done

KEY = ModelKey("f.a", "m")
FNS = frozenset({"f.a"})


def node(est: float = 1.0, disk: float = 2.0, host: float = 0.5) -> ReadyNode:
    return ReadyNode(NodeRef("r1", 1, "x"), "t", "f.a", "m", 0, 0.0, 0.0, (), est, disk, 1.0, 1.0, host)


def executor(eid: str, frac: float = 0.0, resident: bool = False, host: bool = False, load: float = 0.0):
    return ExecutorInfo(
        eid,
        FNS,
        frozenset({KEY}) if resident else frozenset(),
        load,
        host_resident=frozenset({KEY}) if host else frozenset(),
        cached={KEY: frac} if frac else {},
    )


def beat(eid: str, cached: dict[str, list[int]] | None = None, **kw) -> ExecutorHeartbeat:
    return ExecutorHeartbeat(eid, "cpu", "shm", f"seg-{eid}", ["f.a"], cached=cached or {}, **kw)


# -- placement -------------------------------------------------------------------------------------
def test_best_fit_prefers_the_executor_with_more_of_the_model_cached():
    n = node()
    assert best_fit(n, [executor("a", 0.0), executor("b", 0.5)]).id == "b"
    assert best_fit(n, [executor("a", 0.8), executor("b", 0.3)]).id == "a"
    assert best_fit(n, [executor("a", 0.3), executor("b", 0.8)]).id == "b"
    # Cached fraction comes before load: the busier executor with more of the model wins.
    assert best_fit(n, [executor("a", 0.3), executor("b", 0.8, load=5.0)]).id == "b"


def test_full_residency_beats_a_partly_cached_model_and_partial_beats_the_host_tier():
    n = node()
    full, partial = executor("z-full", resident=True), executor("a-partial", 0.9)
    assert best_fit(n, [partial, full]).id == "z-full"
    assert best_fit(n, [executor("a-host", host=True), executor("b-partial", 0.1)]).id == "b-partial"
    # Equal fractions: the host tier breaks the tie, as before.
    assert best_fit(n, [executor("a", 0.5), executor("b", 0.5, host=True)]).id == "b"


def test_a_fully_resident_model_ranks_the_same_whether_listed_as_cached_or_not():
    n = node()
    listed = ExecutorInfo("b", FNS, frozenset({KEY}), cached={KEY: 1.0})
    assert best_fit(n, [executor("a", resident=True), listed]).id == "a"  # tie: id
    assert charge_for(n, listed) == charge_for(n, executor("a", resident=True)) == 1.0


# -- charging --------------------------------------------------------------------------------------
def test_the_charge_counts_the_part_of_the_load_not_cached_from_the_tier_it_would_come_from():
    n = node(est=1.0, disk=2.0, host=0.5)
    assert charge_for(n, executor("a", 0.25)) == pytest.approx(1.0 + 1.5)
    assert charge_for(n, executor("a", 0.25, host=True)) == pytest.approx(1.0 + 0.75 * 0.5)
    assert charge_for(n, executor("a")) == 3.0  # nothing cached: the whole load
    assert charge_for(n, executor("a", resident=True)) == 1.0  # fully resident: no load


# -- estimates -------------------------------------------------------------------------------------
def test_a_partial_load_is_learnt_as_its_whole_model_equivalent():
    est = Estimator()
    est.observe("f.a", "m", "", "cpu", run_s=1.0, load_s=0.5, load_frac=0.25)
    assert est.load_estimate("f.a", "m", "cpu") == 2.0
    assert est.load_estimate("f.a", "m") == 2.0


def test_a_load_without_a_fraction_is_a_whole_load_and_a_bad_fraction_is_not_learnt(caplog):
    est = Estimator()
    est.observe("f.a", "m", "", "cpu", run_s=1.0, load_s=0.5)  # an executor that predates load_frac
    assert est.load_estimate("f.a", "m", "cpu") == 0.5
    with caplog.at_level(logging.ERROR):
        for bad in (math.nan, math.inf, 1.5, -0.5):
            est.observe("f.a", "m", "", "cpu", run_s=1.0, load_s=9.0, load_frac=bad)
    assert est.load_estimate("f.a", "m", "cpu") == 0.5
    assert len([r for r in caplog.records if "load_frac" in r.getMessage()]) == 4
    est.observe("f.a", "m", "", "cpu", run_s=1.0, load_s=0.0, load_frac=0.0)  # resident: no load
    assert est.load_estimate("f.a", "m", "cpu") == 0.5


# -- heartbeats ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, frac",
    [
        ([2, 4, 50, 100], 0.5),
        ([4, 4, 100, 100], 1.0),
        ([0, 4, 0, 100], 0.0),
        ([2, 4, 50], None),  # wrong length
        ([2, 4, 50, 100, 1], None),
        ([-1, 4, 50, 100], None),  # negative
        ([2, 4, -50, 100], None),
        ([5, 4, 50, 100], None),  # more resident than total
        ([2, 4, 150, 100], None),
        ([2, 4, 0, 0], None),  # no bytes, yet only some layers resident
        ([1, 1, 0, 0], 1.0),  # a model without weights (a noise sampler): whole
        ([0, 1, 0, 0], None),
        ([0, 0, 50, 100], None),
        ([True, 4, 50, 100], None),
        ([2.0, 4, 50, 100], None),
    ],
)
def test_a_cached_entry_decodes_to_the_fraction_of_bytes_or_is_malformed(value, frac):
    assert cached_fraction(value) == frac


def test_a_heartbeat_with_cached_models_reaches_the_snapshot_and_malformed_entries_are_dropped(caplog):
    core = SchedulerCore(get_policy("fifo"))
    report = beat(
        "e1",
        cached={
            "f.a|m": [3, 4, 60, 100],
            "f.a|full": [4, 4, 10, 10],
            "f.a|bad": [3, 2, 1, 1],  # more layers resident than it has
            "no-bar": [1, 4, 1, 4],  # not a model key
            "f.a|short": [1, 4],
        },
        resident=["f.a|r"],
        arena_capacity=100,
        arena_free=40,
    )
    for seq in (1, 2):
        report.seq = seq
        assert core.on_heartbeat(report, float(seq)) == []
    state = core.executors["e1"]  # registered, and the rest of the report applies
    assert state.resident == {ModelKey("f.a", "r")} and (state.arena_capacity, state.arena_free) == (100, 40)
    assert dict(state.cached) == {KEY: 0.6, ModelKey("f.a", "full"): 1.0, ModelKey("f.a", "r"): 1.0}
    (info,) = core.snapshot(2.0).idle
    assert info.cached is state.cached  # shared, not copied, per snapshot
    assert info.fraction(KEY) == 0.6 and info.fraction(ModelKey("f.a", "other")) == 0.0
    warnings = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1  # once per change, not every beat
    assert all(s in warnings[0] for s in ("f.a|bad", "no-bar", "f.a|short"))
    # The next report drops the model from the cache: the fraction goes with it.
    core.on_heartbeat(beat("e1", seq=3), 3.0)
    assert dict(core.executors["e1"].cached) == {}


def _core(cached_on_e2: dict[str, list[int]] | None) -> tuple[SchedulerCore, float]:
    est = Estimator(defaults={"f.a": 1.0})
    est.observe("f.a", "m", "", "cpu", run_s=1.0, load_s=0.5, load_frac=0.25)  # whole load: 2.0 s
    core = SchedulerCore(get_policy("fair", 5.0), estimator=est)
    core.on_heartbeat(beat("e1"), 0.0)
    core.on_heartbeat(beat("e2", cached_on_e2), 0.0)
    core.add_request(ImageRequest("r1", "alice", "w", 1, {}, 0.0), chain(1), attempt=1, now=0.0)
    return core, est.estimate("f.a", "m", kind="cpu")


@pytest.mark.parametrize(
    "cached, executor, charge",
    [
        (None, "e1", 1.0 + 2.0),  # nothing cached anywhere: the id decides, the whole load is charged
        ({"f.a|m": [2, 4, 50, 100]}, "e2", 1.0 + 1.0),  # half of the model on e2
        ({"f.a|m": [1, 4, 75, 100]}, "e2", 1.0 + 0.5),
        ({"f.a|m": [4, 4, 100, 100]}, "e2", 1.0),
    ],
)
def test_the_core_dispatches_to_the_executor_holding_the_model_and_charges_the_rest_of_the_load(
    cached, executor, charge
):
    core, run_s = _core(cached)
    assert run_s == 1.0
    (a,) = core.policy(core.snapshot(0.0)).assignments
    assert (a.executor, a.charge_s) == (executor, pytest.approx(charge))
    effects = core.schedule(0.0)
    (d,) = [e for e in effects if isinstance(e, SendDispatch)]
    assert d.executor == executor
    assert ChargeVTime("alice", delta=pytest.approx(charge), ops=1) in effects
    assert core.accounts["alice"].vtime == pytest.approx(charge)
    # The completion charges what was measured, and its partial load trains the whole-model estimate.
    msg = msgspec.structs.replace(
        done(d, total_s=1.25, load_s=0.25),
        timing=NodeTiming(load_s=0.25, exec_s=1.0, load_tier="disk", load_frac=0.5),
    )
    core.on_complete(msg, 1.0)
    assert core.accounts["alice"].vtime == pytest.approx(1.25)
    assert core.estimator.load_estimate("f.a", "m", "cpu") == pytest.approx(2.0 + 0.3 * (0.5 - 2.0))


# -- the wire --------------------------------------------------------------------------------------
def test_the_new_heartbeat_and_timing_fields_round_trip():
    hb = beat("e1", cached={"f.a|m": [2, 4, 50, 100]}, resident=["f.a|r"], seq=7)
    assert sched_decoder.decode(encode(hb)) == hb
    timing = NodeTiming(load_s=0.5, exec_s=1.0, load_tier="host", load_bytes=10, load_frac=0.25)
    complete = NodeComplete("e1", "r1", 1, "n", timing=timing)
    back = sched_decoder.decode(encode(complete))
    assert back == complete and back.timing.load_frac == 0.25
    # Defaults are left off the wire, and an old message without the fields decodes to them.
    assert b"cached" not in encode(beat("e1")) and b"load_frac" not in encode(NodeTiming(exec_s=1.0))
    assert sched_decoder.decode(encode(NodeComplete("e1", "r1", 1, "n"))).timing.load_frac == 0.0


@pytest.mark.parametrize("value", [b"1.5", b"-0.25", b"1e400", b"null", b"NaN"])
def test_a_completion_with_a_load_fraction_outside_0_1_is_refused_where_it_is_decoded(value):
    raw = encode(NodeComplete("e1", "r1", 1, "n", timing=NodeTiming(load_s=1.0, load_frac=0.5)))
    raw = raw.replace(b'"load_frac":0.5', b'"load_frac":' + value)
    with pytest.raises(msgspec.DecodeError) as err:  # the scheduler logs it and drops the event
        sched_decoder.decode(raw)
    assert value == b"NaN" or "load_frac" in str(err.value)


# -- the executor's side -----------------------------------------------------------------------------
class _Runner:
    cancels_cleanly = True
    host_report_blocks = False

    def request_ended(self, request_id: str) -> None:
        pass

    def resident(self) -> list[ModelKey]:
        return [ModelKey("f.a", "full")]

    def cached(self) -> dict[ModelKey, tuple[int, int, int, int]]:
        return {
            KEY: (1, 4, 30, 100),
            ModelKey("f.a", "full"): (4, 4, 100, 100),
            ModelKey("f.a", "x"): (0, 4, 0, 9),
        }

    def host_report(self) -> tuple[list[ModelKey], dict[str, int]]:
        return [], {}


class _Store:
    class transport:
        kind, address = "shm", "seg-e1"

    def stats(self) -> dict[str, int]:
        return {"capacity": 100, "free": 100}


class _Bus:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append(data)


async def test_the_executor_heartbeat_reports_models_with_any_layer_on_the_device():
    from libs.protocol.subjects import Subjects
    from services.executor.service import ExecutorService

    bus = _Bus()
    svc = ExecutorService(
        executor_id="e1",
        kind="cpu",
        nc=bus,  # type: ignore[arg-type]
        subjects=Subjects("t"),
        store=_Store(),  # type: ignore[arg-type]
        runner=_Runner(),  # type: ignore[arg-type]
        images=None,  # type: ignore[arg-type]
        fns=["f.a"],
    )
    await svc.heartbeat()
    (hb,) = [sched_decoder.decode(m) for m in bus.sent]
    assert isinstance(hb, ExecutorHeartbeat)
    assert hb.cached == {"f.a|m": [1, 4, 30, 100], "f.a|full": [4, 4, 100, 100]}  # no empty entries
    assert hb.resident == ["f.a|full"]
