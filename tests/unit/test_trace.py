"""The trace generator (libs/sim/trace.py): rates, burstiness, popularity, scales, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from libs.sim import trace as T

SOLO = {f"w{i:02d}": 0.5 + 0.25 * i for i in range(20)}
N = 20_000  # arrivals per long trace: ±5% on the rate, ±10% on the CoV


def long_trace(**kw):
    kw.setdefault("rate", 10.0)
    kw.setdefault("duration_s", N / kw["rate"] / kw.get("rate_scale", 1.0))
    return T.generate(SOLO, **kw)


@pytest.mark.parametrize("cov", [1.0, 2.0, 3.0])
def test_rate_and_cov_match_what_was_asked(cov: float) -> None:
    st = T.stats(long_trace(cov=cov, seed=7))
    assert st["rate"] == pytest.approx(10.0, rel=0.05)
    assert st["cov"] == pytest.approx(cov, rel=0.10)


def test_popularity_follows_zipf() -> None:
    tr = long_trace(seed=3, zipf_s=1.0)
    counts = np.array([sum(r.workflow == w for r in tr) for w in SOLO])
    expected = T.zipf_weights(len(SOLO), 1.0) * len(tr)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 43.8  # chi-square, 19 degrees of freedom, p = 0.001
    assert counts[0] / counts[-1] == pytest.approx(20.0, rel=0.25)  # 1/1 over 1/20


def test_uniform_popularity_at_zero_skew() -> None:
    assert np.allclose(T.zipf_weights(5, 0.0), 0.2)


def test_rate_scale_multiplies_the_rate() -> None:
    a = T.stats(long_trace(seed=1))["rate"]
    b = T.stats(long_trace(seed=1, rate_scale=2.5))["rate"]
    assert b / a == pytest.approx(2.5, rel=0.05)


def test_slo_scale_multiplies_deadlines() -> None:
    short = dict(rate=5.0, duration_s=100.0, seed=2)
    three = T.generate(SOLO, slo_scale=3.0, **short)
    five = T.generate(SOLO, slo_scale=5.0, **short)
    assert [r[:3] for r in three] == [r[:3] for r in five]
    for r3, r5 in zip(three, five, strict=True):
        assert r3.deadline_s == pytest.approx(3.0 * SOLO[r3.workflow])
        assert r5.deadline_s == pytest.approx(5.0 * SOLO[r5.workflow])


def test_deterministic_by_seed(tmp_path) -> None:
    a = T.generate(SOLO, rate=5.0, duration_s=200.0, cov=2.0, seed=11)
    b = T.generate(SOLO, rate=5.0, duration_s=200.0, cov=2.0, seed=11)
    c = T.generate(SOLO, rate=5.0, duration_s=200.0, cov=2.0, seed=12)
    assert a == b and a != c
    assert all(x.t <= y.t for x, y in zip(a, a[1:], strict=False))
    path = tmp_path / "trace.jsonl"
    T.save(path, a)
    assert T.load(path) == a


def test_tenants_own_their_workflows() -> None:
    tr = long_trace(seed=5, tenants=8, tenants_per_workflow=2)
    owners: dict[str, set[str]] = {}
    for r in tr:
        owners.setdefault(r.workflow, set()).add(r.tenant)
    assert all(1 <= len(ts) <= 2 for ts in owners.values())
    assert len({r.tenant for r in tr}) > 1


def test_resample_keeps_window_rates_and_scales_cov() -> None:
    rng = np.random.default_rng(0)
    # A base trace whose rate changes per window (a quiet and a busy phase), CoV 2 throughout.
    base = np.concatenate(
        [T.gamma_arrivals(4.0, 2.0, 2000.0, rng), T.gamma_arrivals(12.0, 2.0, 1000.0, rng, 2000.0)]
    )
    out = T.resample(base, window_s=250.0, rng=np.random.default_rng(1), cov_scale=1.5, duration_s=3000.0)
    quiet, busy = out[out < 2000.0], out[out >= 2000.0]
    assert len(quiet) / 2000.0 == pytest.approx(4.0, rel=0.05)
    assert len(busy) / 1000.0 == pytest.approx(12.0, rel=0.05)
    assert T.iat_cov(busy) == pytest.approx(3.0, rel=0.10)
    doubled = T.resample(
        base, window_s=250.0, rng=np.random.default_rng(1), rate_scale=2.0, duration_s=3000.0
    )
    assert len(doubled) / len(base) == pytest.approx(2.0, rel=0.05)


def test_generate_from_a_base_trace() -> None:
    base = T.gamma_arrivals(8.0, 1.5, 1500.0, np.random.default_rng(4))
    tr = T.generate(SOLO, base=base, duration_s=1500.0, window_s=100.0, cov_scale=2.0, seed=9)
    assert T.stats(tr)["cov"] == pytest.approx(3.0, rel=0.10)
    assert len(tr) / len(base) == pytest.approx(1.0, rel=0.05)
