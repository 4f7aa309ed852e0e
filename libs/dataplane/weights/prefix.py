"""How many first layers to keep on the device so loading the rest hides behind computing the first.

The paper (ServerlessT2I, arXiv 2607.26566, §5.1) pipelines loading with execution: while layer ``i``
computes, later layers load, one after another. With ``L`` uniform layers, ``Lₑ`` of them already
resident, a per-layer load time ``T_load`` and compute time ``T_comp``, one forward takes

    T_e2e(Lₑ) = max(L·T_comp, (L − Lₑ)·T_load + T_comp)                         (Eq. 1)

and the shortest prefix that hides loading completely is

    Lₑ′ = (L·T_load − L·T_comp + T_comp) / T_load                                 (Eq. 2)

Real models are not uniform (a Flux transformer has embedders, 19 double and 38 single blocks and an
output head; a VAE decoder's up-blocks differ in size), so :func:`pipelined_seconds` evaluates the
pipeline exactly for per-layer times, and :func:`prefix_length` finds the smallest prefix whose
forward is not slowed by loading. For uniform layers they agree with Eq. 1 and Eq. 2 whenever at
least one layer is resident; with none, the first layer's load cannot hide behind anything, so the
exact time is ``max(T_load + L·T_comp, L·T_load + T_comp)`` and the shortest prefix is
``max(1, ⌈Eq. 2⌉)`` (:func:`uniform_prefix` is Eq. 2 as printed). Pure functions: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EPSILON = 1e-9  # relative slack when comparing a pipelined forward with the compute alone


def pipelined_seconds(
    load: Sequence[float], comp: Sequence[float], resident: int, startup: float = 0.0
) -> float:
    """One forward with layers ``[0, resident)`` on the device and the others loading in order from
    time 0, each layer starting once the previous one finished and its own weights landed.

    ``load[i]``/``comp[i]`` are layer ``i``'s load and compute seconds; ``startup`` is a load's
    latency before its first byte lands (opening files, the first chunk), paid once by whatever
    layer loads first. Layer ``i`` (not resident) lands at ``R_i = startup + Σ load[resident..i]``;
    it starts at ``S_i = max(S_{i-1} + comp[i-1], R_i)``. Returns the end of the last layer
    (``Σ comp`` when loading is hidden)."""
    if len(load) != len(comp):
        raise ValueError(f"load has {len(load)} layers, comp has {len(comp)}")
    if not 0 <= resident <= len(load):
        raise ValueError(f"resident must be in [0, {len(load)}], got {resident}")
    landed = startup if resident < len(load) else 0.0
    end = 0.0
    for i, (ld, c) in enumerate(zip(load, comp, strict=True)):
        if i >= resident:
            landed += ld
            end = max(end, landed)
        end += c
    return end


def sequential_seconds(load: Sequence[float], comp: Sequence[float], resident: int = 0) -> float:
    """The same forward without pipelining: every missing layer loads, then the model computes."""
    return sum(load[resident:]) + sum(comp)


def prefix_length(load: Sequence[float], comp: Sequence[float], startup: float = 0.0) -> int:
    """Lₑ′ for non-uniform layers: the fewest first layers to keep resident so that loading the rest
    in order, while the model computes, does not delay the forward (Eq. 2, generalised; with
    ``startup``, each load's latency to its first byte).

    The stall only shrinks as the prefix grows, so a binary search over ``[0, L]`` finds it."""
    total = sum(comp)
    slack = EPSILON * max(total, 1e-12)
    lo, hi = 0, len(load)
    while lo < hi:
        mid = (lo + hi) // 2
        if pipelined_seconds(load, comp, mid, startup) <= total + slack:
            hi = mid
        else:
            lo = mid + 1
    return lo


def uniform_prefix(layers: int, t_load: float, t_comp: float) -> int:
    """Eq. 2 as the paper states it for ``layers`` uniform layers, rounded up to whole layers and
    clamped to ``[0, layers]`` (loading faster than computing needs no prefix beyond layer 0)."""
    if layers <= 0:
        return 0
    if t_load <= 0:
        return 0
    exact = (layers * t_load - layers * t_comp + t_comp) / t_load
    return min(layers, max(0, math.ceil(exact - EPSILON)))
