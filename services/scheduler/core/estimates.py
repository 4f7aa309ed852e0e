"""Estimated execution time of a node, learnt from the times executors measure (paper §6).

At dispatch the scheduler charges the owner an *estimate* so it can decide at once; on completion
the estimate is replaced by the measured time. Estimates come from history, most specific first:

1. (ModelFn, model, input shapes, executor kind) — e.g. the denoiser at 1024x1024 on an H800;
2. (ModelFn, model, input shapes) on any executor kind;
3. (ModelFn, model, executor kind);
4. (ModelFn, model);
5. the ModelFn's configured default, else ``default_s`` (0.1 s) before any history exists.

Each level keeps an exponentially weighted moving average (``alpha`` = 0.3), so estimates follow
drift (a warmer cache, a busier host) without being thrown by one outlier. Loading is estimated
separately, per (ModelFn, model, kind) and per tier it was read from — ``disk`` or ``host`` (the
box's host-memory tier) — always as the time to load the *whole* model: a completion that loaded
only part of it (a prefix of its layers was resident, paper §5.1) counts as ``load_s / load_frac``.
The charge at dispatch is the part the chosen executor lacks, at the estimate of the tier that
executor would load from (``snapshot.charge_for``). Before any host-tier load has been seen, a host
load is estimated at the disk load (never more). Pure and synchronous: the scheduler core owns one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

DEFAULT_S = 0.1  # before any history: small, so a new workflow is not starved by a guess
DEFAULT_LOAD_S = 0.0  # unknown loads are not charged up front; the measurement corrects it

log = logging.getLogger(__name__)


def shape_key(shapes: Iterable[tuple[str, list[int]]]) -> str:
    """A key for a node's tensor input shapes: ``"latents=1x4096x64;prompt_embeds=1x512x4096"``."""
    return ";".join(f"{name}={'x'.join(map(str, shape))}" for name, shape in sorted(shapes))


class Estimator:
    def __init__(
        self,
        defaults: Mapping[str, float] | None = None,
        *,
        default_s: float = DEFAULT_S,
        alpha: float = 0.3,
    ) -> None:
        self.defaults = dict(defaults or {})
        self.default_s = default_s
        self.alpha = alpha
        self._exec: dict[tuple, float] = {}
        self._load: dict[tuple, float] = {}

    def _update(self, table: dict[tuple, float], key: tuple, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.alpha * (value - old)

    def observe(
        self,
        fn: str,
        model: str,
        shapes: str,
        kind: str,
        run_s: float,
        load_s: float = 0.0,
        load_tier: str = "disk",
        load_frac: float = 0.0,
    ) -> None:
        """Record one completion: ``run_s`` = fetch + execute + store; ``load_s`` when it loaded,
        from ``load_tier`` (``disk`` or ``host``), ``load_frac`` of the model's bytes (0 from an
        executor that does not report it: a whole load). The load is learnt as its whole-model
        equivalent, ``load_s / load_frac``; a fraction outside (0, 1] is logged and not learnt."""
        for key in ((fn, model, shapes, kind), (fn, model, shapes), (fn, model, kind), (fn, model)):
            self._update(self._exec, key, run_s)
        if load_s > 0:
            frac = 1.0 if load_frac == 0.0 else load_frac
            if not (math.isfinite(frac) and 0.0 < frac <= 1.0):
                log.error(
                    "load of %s/%s reported load_frac=%r, not in [0, 1]; not learnt", fn, model, load_frac
                )
                return
            whole = load_s / frac
            tier = "host" if load_tier == "host" else "disk"
            self._update(self._load, (fn, model, kind, tier), whole)
            self._update(self._load, (fn, model, tier), whole)

    def estimate(self, fn: str, model: str, shapes: str | None = None, kind: str | None = None) -> float:
        keys: list[tuple] = []
        if shapes is not None and kind is not None:
            keys.append((fn, model, shapes, kind))
        if shapes is not None:
            keys.append((fn, model, shapes))
        if kind is not None:
            keys.append((fn, model, kind))
        keys.append((fn, model))
        for key in keys:
            if key in self._exec:
                return self._exec[key]
        return self.defaults.get(fn, self.default_s)

    def load_estimate(self, fn: str, model: str, kind: str | None = None, tier: str = "disk") -> float:
        """Seconds to load ``model`` for ``fn`` from ``tier`` (``disk`` or ``host``)."""
        for t in (tier, "disk") if tier == "host" else (tier,):
            if kind is not None and (fn, model, kind, t) in self._load:
                return self._load[(fn, model, kind, t)]
            if (fn, model, t) in self._load:
                return self._load[(fn, model, t)]
        return DEFAULT_LOAD_S
