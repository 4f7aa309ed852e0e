"""The fairness bound of paper §6, as a property over random workloads, on the real scheduler core.

For any two tenants that stay eligible-backlogged over an interval, the difference in the service
(vTime) they receive over it never exceeds 2(Δ + L_max) under the fair policy; FIFO exceeds it in a
constructed case.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core.policy import get_policy
from tests.support.fairsim import Arrival, max_service_gap, simulate, windows

costs = st.floats(min_value=0.01, max_value=10.0, allow_nan=False).map(lambda c: round(c, 3))


@st.composite
def workloads(draw):
    """Two tenants, each with a fixed chain shape (costs per position), arriving at random times."""
    shapes = {t: tuple(draw(st.lists(costs, min_size=1, max_size=4))) for t in ("f", "g")}
    arrivals = []
    for t in ("f", "g"):
        n = draw(st.integers(min_value=1, max_value=25))
        times = draw(
            st.lists(st.floats(min_value=0.0, max_value=60.0, allow_nan=False), min_size=n, max_size=n)
        )
        arrivals += [Arrival(round(at, 3), t, shapes[t]) for at in times]
    return sorted(arrivals, key=lambda a: (a.at, a.tenant))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=workloads(),
    executors=st.integers(min_value=1, max_value=4),
    slack=st.sampled_from([0.0, 0.5, 5.0, 10.0, 20.0]),
)
def test_eligible_backlogged_tenants_never_differ_by_more_than_2_delta_plus_lmax(arrivals, executors, slack):
    trace = simulate(get_policy("fair", slack), arrivals, executors)
    bound = 2 * (slack + trace.max_charge)
    for w in windows(trace, "f", "g"):
        gap = max_service_gap(w, "f", "g")
        assert gap <= bound + 1e-9, (gap, bound, [(s.t, s.vtime) for s in w][:10])


def test_fifo_exceeds_the_bound_when_one_tenants_requests_cost_ten_times_more():
    # Alternating arrivals at the same rate: FIFO serves equal request counts, so the expensive
    # tenant receives ten times the GPU time while both stay backlogged.
    arrivals = [Arrival(i * 0.1, "f", (10.0,)) for i in range(30)] + [
        Arrival(i * 0.1 + 0.05, "g", (1.0,)) for i in range(30)
    ]
    fifo = simulate(get_policy("fifo"), arrivals, executors=2)
    gap = max(max_service_gap(w, "f", "g") for w in windows(fifo, "f", "g"))
    bound = 2 * (0.0 + fifo.max_charge)
    assert gap > 3 * bound, (gap, bound)
    fair = simulate(get_policy("fair", 0.0), arrivals, executors=2)
    assert max(max_service_gap(w, "f", "g") for w in windows(fair, "f", "g")) <= bound


def paper_lifts(snapshot, slack_s=0.0):
    """Algorithm 1's lift taken literally: only new/returning tenants, up to the active minimum."""
    ready = {n.tenant for n in snapshot.ready}
    settled = [t.vtime for t in snapshot.tenants.values() if t.active and not t.returning]
    if not settled:
        return {}
    floor = min(settled)
    return {n: floor for n, t in snapshot.tenants.items() if t.returning and n in ready and t.vtime < floor}


# Workloads hypothesis found where the literal lift breaks the bound (each named after how).
COUNTEREXAMPLES = {
    # g's only node runs while f takes the other executors; g's next requests arrive while one is
    # still in progress, so g is not "returning" and rejoins with credit.
    "rejoin with credit": (
        [Arrival(0.0, "f", (6.0,))] * 5 + [Arrival(0.0, "g", (7.0,))] + [Arrival(1.0, "g", (7.0,))] * 3,
        4,
    ),
    # Both tenants' work is all running when new requests arrive for both at once: nobody is
    # waiting to compare against, and the gap built up meanwhile carries into the interval.
    "both rejoin at once": (
        [Arrival(0.0, "f", (5.0,))] * 3
        + [Arrival(0.0, "g", (4.0,)), Arrival(1.0, "f", (5.0,))]
        + [Arrival(1.0, "g", (4.0,))] * 3,
        4,
    ),
}


@pytest.mark.parametrize("case", list(COUNTEREXAMPLES))
def test_the_literal_lift_breaks_the_bound_where_joining_tenants_are_placed_and_ours_keeps_it(case):
    from services.scheduler.core import policy as pol

    arrivals, executors = COUNTEREXAMPLES[case]
    ours = simulate(get_policy("fair", 0.0), arrivals, executors)
    bound = 2 * ours.max_charge
    assert all(max_service_gap(w, "f", "g") <= bound for w in windows(ours, "f", "g"))
    original = pol.vtime_lifts
    try:
        pol.vtime_lifts = paper_lifts
        literal = simulate(get_policy("fair", 0.0), arrivals, executors)
    finally:
        pol.vtime_lifts = original
    assert max(max_service_gap(w, "f", "g") for w in windows(literal, "f", "g")) > bound
