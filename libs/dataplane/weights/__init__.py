"""GPU memory as one elastic cache of model layers (paper ServerlessT2I, arXiv 2607.26566, §5.1 and
§5.3): the prefix arithmetic (:mod:`.prefix`) and the residency policy (:mod:`.policy`), both pure
and torch-free so real and simulated executors share them."""

from libs.dataplane.weights.policy import ARENA, DEVICE, REGIONS, CachePolicy, Eviction, NoRoom
from libs.dataplane.weights.prefix import (
    pipelined_seconds,
    prefix_length,
    sequential_seconds,
    uniform_prefix,
)

__all__ = [
    "ARENA",
    "DEVICE",
    "REGIONS",
    "CachePolicy",
    "Eviction",
    "NoRoom",
    "pipelined_seconds",
    "prefix_length",
    "sequential_seconds",
    "uniform_prefix",
]
