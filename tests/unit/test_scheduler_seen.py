"""What the policy sees of a ready node (``services/scheduler/core/seen.py``): the value built for a
ready node is reused from round to round while nothing about the node changed, and rebuilt when its
request's tensors change, when it leaves READY and comes back, or when its estimates are older than
``VIEW_REUSE_S``."""

from __future__ import annotations

from services.scheduler.core import seen
from services.scheduler.core.policy import fifo
from services.scheduler.core.scheduling import SchedulerCore
from tests.unit.test_scheduler_core import complete, dispatches, hb, request, toy_dag


def ready(core: SchedulerCore, now: float) -> dict[str, object]:
    return {f"{n.request_id}/{n.node_id}": n for n in core.snapshot(now).ready}


def test_a_ready_node_is_shown_as_the_same_value_until_something_about_it_changes():
    core = SchedulerCore(fifo)
    core.on_heartbeat(hb("e1"), 0.0)  # its kind is what the estimates are for
    core.add_request(request("r1"), toy_dag(), attempt=1, now=0.0)
    core.add_request(request("r2"), toy_dag(), attempt=1, now=0.0)
    first = ready(core, 0.0)
    assert sorted(first) == ["r1/encode", "r1/prepare", "r2/encode", "r2/prepare"]
    again = ready(core, 0.01)
    assert all(again[k] is first[k] for k in first)  # nothing changed: reused as they are

    # r1's encode runs and completes: r1's tensors changed, so its other ready node is rebuilt
    # (with the estimate the completion just taught the estimator); r2's nodes are not.
    (d,) = dispatches(core.schedule(0.01))
    assert d.msg.node_id == "encode" and d.msg.request_id == "r1"
    core.on_complete(complete(d), 0.02)  # it ran 0.5 s: the estimator learns that
    after = ready(core, 0.02)
    assert after["r1/prepare"] is not first["r1/prepare"]
    assert after["r2/prepare"] is first["r2/prepare"]
    learned = core.estimator.estimate(
        d.msg.fn, d.msg.model, seen.input_shapes(core.runs["r2"], "encode"), "cpu"
    )
    assert after["r2/encode"] is first["r2/encode"] and after["r2/encode"].est_s != learned

    # Past VIEW_REUSE_S every value is rebuilt, with the estimates as they are now.
    late = ready(core, 0.02 + seen.VIEW_REUSE_S + 0.001)
    assert late["r2/encode"] is not first["r2/encode"]
    assert late["r2/encode"].est_s == learned
