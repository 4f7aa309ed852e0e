"""A scheduler run with faults, recorded (``T2I_SCHEDULER_RECORD``) and replayed into fresh state
machines without brokers (services/scheduler/replay.py): every event of every leadership returns the
effects it returned live. The run has a request past its deadline, a cancel, an executor lost mid-request
and a fail-over (the lease taken away: the leader steps down, the same process leads again as a new
reign, i.e. a new section with a fresh machine), on the real NATS and Redis with simulated executors."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from libs.protocol.messages import CancelRequest, encode
from services.scheduler.replay import replay, sections
from tests.integration.test_scheduler_faults import World, profile, until


@pytest.fixture
async def world(common):
    async with World(common) as w:
        yield w


async def test_a_recorded_run_with_faults_replays_to_the_same_effects(world, tmp_path):
    recording = tmp_path / "scheduler.rec"
    await world.start_registry()
    process = world.add_scheduler(record=str(recording), heartbeat_timeout_s=1.0, lease_ttl_s=1.5)
    assert await until(lambda: process.leading, 30.0)
    first = process.current
    doomed = await world.add_executor("doomed", profile())
    await world.add_executor("steady", profile())

    ok = await world.submit(3)
    (late,) = await world.submit(submitted_at=time.time() - 1000, timeout_s=60.0)  # past its deadline
    (short,) = await world.submit(timeout_s=0.8)  # may run out of time in the core
    (cancelled,) = await world.submit()
    assert await until(lambda: cancelled in first.core.runs, 10.0)  # in the core: its cancel is the core's
    await world.nc.publish(world.subjects.cancels, encode(CancelRequest(cancelled, "tenant-a")))
    # The doomed executor goes silent mid-way: its nodes rerun on the steady one.
    assert await until(lambda: doomed.current is not None, 10.0)
    await doomed.stop()
    done = await world.wait_results([*ok, late, short, cancelled], within_s=30.0)
    assert {r: done[r].status for r in ok} == dict.fromkeys(ok, "succeeded")
    assert done[late].error_code == "timeout" and done[short].status in ("failed", "succeeded")
    assert done[cancelled].status in ("cancelled", "succeeded")

    # Fail-over: the lease goes to someone else; the process steps down and leads again, anew.
    await world.redis.set(world.keys.scheduler_lease, "another-scheduler", px=2000)
    assert await until(lambda: process.stepped_down, 10.0)
    assert await until(lambda: process.leading and process.current is not first, 15.0)
    after = await world.submit(2)
    done = await world.wait_results(after, within_s=30.0)
    assert all(done[r].status == "succeeded" for r in after)
    await asyncio.sleep(0.3)

    recorded = list(sections(recording))
    assert len(recorded) >= 2  # one section per leadership
    events = Counter(type(e[2]).__name__ for s in recorded for e in s[1:])
    assert events["TakenIn"] >= 7 and events["Cancel"] >= 1 and events["DispatchAnswer"] > 0
    assert events["Tick"] > 0 and events["FromExecutor"] > 0 and events["Round"] > 0
    executor_events = Counter(
        type(e[2].event).__name__ for s in recorded for e in s[1:] if hasattr(e[2], "event")
    )
    assert executor_events["ExecutorHeartbeat"] > 0 and executor_events["NodeComplete"] > 0
    assert all(type(s[1][2]).__name__ == "Seed" for s in recorded)  # each leader starts from Redis's vTime
    for section in recorded:
        machine, mismatches = replay(section)
        assert mismatches == [], mismatches[:3]
    # The replayed machine ends where the live one did: the last section's leader is the live one.
    live = process.current.machine
    assert sorted(machine.core.runs) == sorted(live.core.runs)
    assert sorted(machine.core.executors) == sorted(live.core.executors)
    assert len(machine.backlog) == len(live.backlog) and machine.cancelled == live.cancelled


def test_a_replay_reports_an_event_whose_effects_differ(tmp_path):
    import contextlib

    from services.scheduler.__main__ import build_machine
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.core.events import Round, Tick
    from services.scheduler.replay import Mismatch

    path = tmp_path / "r.rec"
    stack = contextlib.AsyncExitStack()
    machine = build_machine(stack, SchedulerConfig(record=str(path), view_s=100.0))
    machine.handle(Round(), 1.0)
    machine.handle(Tick(wall=5.0), 2.0)
    machine.handle(Tick(wall=5.0), 3.0)
    asyncio.run(stack.aclose())  # closes the recording
    (section,) = sections(path)
    assert len(section) == 4 and replay(section)[1] == []
    kind, seq, event, now, recorded = section[-1]
    assert "WriteBacklog" in recorded and "WriteViews" not in recorded  # the views are every 100 s
    section[-1] = (kind, seq, event, now, "[something else]")
    assert replay(section)[1] == [Mismatch(seq, "Tick", "[something else]", recorded)]
