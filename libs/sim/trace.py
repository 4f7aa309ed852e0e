"""Request traces for evaluation at scale (ServerlessT2I, arXiv 2607.26566, §8.1-§8.2): who sends
which workflow when, and by when it must finish.

A trace is a list of :class:`Request` ``(t, tenant, workflow, deadline_s)``, sorted by ``t``
(seconds from the start); ``deadline_s`` is relative to ``t``. It is built in three steps:

1. **Arrival times.** Either a Gamma renewal process at a mean rate and an inter-arrival-time (IAT)
   coefficient of variation (:func:`gamma_arrivals`; CoV 1 is Poisson, above 1 burstier), or a
   *base trace* (any timestamps, e.g. a production trace) **fitted and resampled per window**
   (:func:`resample`, §8.2): the base is cut into windows; in each, the arrivals' mean rate and IAT
   CoV are fitted (a Gamma process by moments: shape ``1/CoV^2``), and new arrivals are drawn from a
   Gamma process with the window's rate times ``rate_scale`` and its CoV times ``cov_scale``.
2. **Workflows.** Each request's workflow is drawn from a Zipf popularity: the i-th workflow (in
   the order given) has weight ``1 / i^zipf_s``. Default ``zipf_s = 1.0``: the classic web and
   serverless skew, under which the top quarter of 20 workflows take ~64% of requests, in line with
   the paper's observation that a few workflows dominate (Appendix A: caching the 10 most popular
   workflows leaves 0.37% misses); 0 gives uniform popularity.
3. **Tenants.** ``tenants`` tenants with Zipf weights ``1 / j^tenant_zipf_s``; each workflow is
   assigned to ``tenants_per_workflow`` tenants drawn at random (the paper assigns workflows to
   tenants' traffic at random, §8.1), and a request of a workflow goes to one of its tenants in
   proportion to their weights. Workflow popularity is therefore exactly the Zipf law above.

Deadlines are ``slo_scale x solo latency`` of the workflow (default SLO scale 3, §8.1; solo
latencies from :func:`libs.sim.settings.solo_latency`). Everything is deterministic given ``seed``.
Traces save to and load from JSON lines (:func:`save`, :func:`load`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

DEFAULT_ZIPF_S = 1.0
DEFAULT_SLO_SCALE = 3.0
MIN_FIT = 10  # arrivals a window needs for its own CoV fit; fewer: the base trace's overall CoV


class Request(NamedTuple):
    t: float
    tenant: str
    workflow: str
    deadline_s: float


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Normalised Zipf weights ``1/i^s`` for ranks 1..n."""
    w = 1.0 / np.arange(1, n + 1, dtype=float) ** s
    return w / w.sum()


def iat_cov(times: Sequence[float] | np.ndarray) -> float:
    """Coefficient of variation of the inter-arrival times (std / mean); NaN under 3 arrivals."""
    iat = np.diff(np.sort(np.asarray(times, dtype=float)))
    if len(iat) < 2 or iat.mean() <= 0:
        return float("nan")
    return float(iat.std() / iat.mean())


def gamma_arrivals(
    rate: float, cov: float, duration_s: float, rng: np.random.Generator, t0: float = 0.0
) -> np.ndarray:
    """Arrival times in ``[t0, t0 + duration_s)`` of a Gamma renewal process: IATs with mean
    ``1/rate`` and coefficient of variation ``cov`` (shape ``1/cov^2``)."""
    if rate <= 0 or duration_s <= 0:
        return np.empty(0)
    if cov <= 0:
        raise ValueError("cov must be > 0")
    shape = 1.0 / cov**2
    scale = 1.0 / (rate * shape)
    chunks: list[np.ndarray] = []
    t = t0
    end = t0 + duration_s
    n = int(rate * duration_s * 1.2) + 16
    while t < end:
        times = t + np.cumsum(rng.gamma(shape, scale, n))
        chunks.append(times[times < end])
        t = float(times[-1])
    return np.concatenate(chunks) if chunks else np.empty(0)


def resample(
    base: Sequence[float] | np.ndarray,
    *,
    window_s: float,
    rng: np.random.Generator,
    rate_scale: float = 1.0,
    cov_scale: float = 1.0,
    duration_s: float | None = None,
) -> np.ndarray:
    """Fit each ``window_s`` window of ``base`` to a Gamma process and draw it again (§8.2): the
    window's mean rate times ``rate_scale``, its fitted IAT CoV times ``cov_scale``. A window with
    fewer than ``MIN_FIT`` arrivals takes the whole base's CoV; an empty one stays empty."""
    times = np.sort(np.asarray(base, dtype=float))
    if duration_s is None:
        duration_s = float(times[-1]) if len(times) else 0.0
    overall = iat_cov(times)
    overall = overall if np.isfinite(overall) and overall > 0 else 1.0
    out: list[np.ndarray] = []
    for w0 in np.arange(0.0, duration_s, window_s):
        w1 = min(w0 + window_s, duration_s)
        inside = times[(times >= w0) & (times < w1)]
        if len(inside) == 0:
            continue
        cov = iat_cov(inside) if len(inside) >= MIN_FIT else overall
        if not np.isfinite(cov) or cov <= 0:
            cov = overall
        rate = len(inside) / (w1 - w0)
        out.append(gamma_arrivals(rate * rate_scale, cov * cov_scale, w1 - w0, rng, t0=w0))
    return np.concatenate(out) if out else np.empty(0)


def assign_tenants(
    workflows: Sequence[str], tenants: int, per_workflow: int, rng: np.random.Generator
) -> dict[str, list[str]]:
    """Each workflow's tenants: ``per_workflow`` distinct tenants ``t00``.. drawn at random."""
    names = [f"t{j:02d}" for j in range(tenants)]
    k = max(1, min(per_workflow, tenants))
    return {w: [names[j] for j in sorted(rng.choice(tenants, size=k, replace=False))] for w in workflows}


def generate(
    solo: Mapping[str, float],
    *,
    rate: float = 1.0,
    duration_s: float = 3600.0,
    cov: float = 1.0,
    zipf_s: float = DEFAULT_ZIPF_S,
    tenants: int = 16,
    tenant_zipf_s: float = 1.0,
    tenants_per_workflow: int = 2,
    rate_scale: float = 1.0,
    slo_scale: float = DEFAULT_SLO_SCALE,
    base: Sequence[float] | None = None,
    window_s: float = 60.0,
    cov_scale: float = 1.0,
    seed: int = 0,
) -> list[Request]:
    """A trace over the workflows of ``solo`` (name -> solo latency, most popular first).

    Without ``base``: Gamma arrivals at ``rate x rate_scale`` per second with IAT CoV
    ``cov x cov_scale``. With ``base`` (timestamps in seconds): fitted and resampled per
    ``window_s`` window with ``rate_scale`` and ``cov_scale`` (:func:`resample`)."""
    rng = np.random.default_rng(seed)
    names = list(solo)
    if not names:
        raise ValueError("no workflows")
    if base is None:
        times = gamma_arrivals(rate * rate_scale, cov * cov_scale, duration_s, rng)
    else:
        times = resample(
            base,
            window_s=window_s,
            rng=rng,
            rate_scale=rate_scale,
            cov_scale=cov_scale,
            duration_s=duration_s,
        )
    owners = assign_tenants(names, tenants, tenants_per_workflow, rng)
    tenant_w = zipf_weights(tenants, tenant_zipf_s)
    picks = rng.choice(len(names), size=len(times), p=zipf_weights(len(names), zipf_s))
    u = rng.random(len(times))
    choosers = {}
    for w, ts in owners.items():
        p = np.array([tenant_w[int(t[1:])] for t in ts])
        choosers[w] = (ts, np.cumsum(p / p.sum()))
    out = []
    for t, i, x in zip(times.tolist(), picks.tolist(), u.tolist(), strict=True):
        w = names[i]
        ts, cdf = choosers[w]
        tenant = ts[min(int(np.searchsorted(cdf, x, side="right")), len(ts) - 1)]
        out.append(Request(round(t, 6), tenant, w, round(slo_scale * solo[w], 6)))
    return out


def save(path: str | Path, trace: Sequence[Request]) -> None:
    """One JSON object per line: ``{"t", "tenant", "workflow", "deadline_s"}``."""
    with Path(path).open("w") as f:
        for r in trace:
            f.write(json.dumps(r._asdict()) + "\n")


def load(path: str | Path) -> list[Request]:
    with Path(path).open() as f:
        return [
            Request(float(d["t"]), d["tenant"], d["workflow"], float(d["deadline_s"]))
            for d in map(json.loads, filter(str.strip, f))
        ]


def stats(trace: Sequence[Request]) -> dict[str, float]:
    """Mean rate (per second over the first to last arrival) and IAT CoV of a trace."""
    t = np.array([r.t for r in trace])
    span = float(t[-1] - t[0]) if len(t) > 1 else 0.0
    return {"n": len(t), "rate": (len(t) - 1) / span if span > 0 else 0.0, "cov": iat_cov(t)}
