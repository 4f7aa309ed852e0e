"""Activations on the device: what a node's run allocates beyond its weights, measured, and what
follows when it does not fit (docs/memory.md, "Device memory on CUDA").

The weight cache leaves each model room for its profiled activations
(``WeightCache.headroom``); :class:`ActivationProfile` is where the runner measures them (CUDA's
peak-allocated counter around ``execute``) and raises them after an out-of-memory error, and
:func:`tile_if_short` decodes in tiles where they would not fit beside the weights resident now.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


class ActivationProfile:
    """Measures each run's activations on ``device`` into ``weights``' profile (nothing on a CPU)."""

    def __init__(self, device: torch.device, weights: Any) -> None:
        self.device = device
        self.weights = weights

    def begin(self) -> int:
        """On CUDA: the bytes allocated before a run, the allocator's peak reset to them."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def end(self, key: Any, base: int) -> None:
        """On CUDA: the run's activations (peak allocated beyond ``base``) into its model's profile."""
        if self.device.type == "cuda":
            self.weights.record_activation(key, torch.cuda.max_memory_allocated(self.device) - base)

    def out_of_memory(self, key: Any) -> None:
        """``key``'s run ran out of memory: its next one leaves more room (a decode then tiles)."""
        room = self.weights.room()
        if room is not None:
            self.weights.record_activation(key, max(room + 1, self.weights.headroom(key) * 2))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def tile_if_short(weights: Any, key: Any, components: dict[str, Any]) -> list[Any]:
    """Where ``key``'s profiled activations do not fit beside the weights resident now, the
    components that can decode in tiles (diffusers' VAEs: ``enable_tiling``) do so for this run;
    returns those switched on (the caller switches them off). Tiled decodes blend overlapping tiles,
    so their images differ slightly from a whole decode's: only what would not fit tiles."""
    if not weights.short_of(key):
        return []
    out = []
    for comp in components.values():
        if callable(getattr(comp, "enable_tiling", None)) and not getattr(comp, "use_tiling", False):
            comp.enable_tiling()
            out.append(comp)
    if out:
        log.info(
            "%s: activations of %d bytes do not fit in %d; decoding in tiles",
            key,
            weights.headroom(key),
            weights.room(),
        )
    return out
