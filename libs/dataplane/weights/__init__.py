"""GPU memory as one elastic cache of model layers (paper ServerlessT2I, arXiv 2607.26566, §5.1 and
§5.3): the prefix arithmetic (:mod:`.prefix`) and the residency policy (:mod:`.policy`), both pure
and torch-free so real and simulated executors share them."""

from libs.dataplane.weights.policy import (
    ARENA,
    DEVICE,
    GRANULARITIES,
    LAYER,
    MODEL,
    NONE,
    REGIONS,
    WORKFLOW,
    CachePolicy,
    Eviction,
    NoRoom,
    cache_granularity,
    cache_key,
    model_of,
    per_model,
)
from libs.dataplane.weights.prefix import (
    pipelined_seconds,
    prefix_length,
    sequential_seconds,
    uniform_prefix,
)

__all__ = [
    "ARENA",
    "DEVICE",
    "GRANULARITIES",
    "LAYER",
    "MODEL",
    "NONE",
    "REGIONS",
    "WORKFLOW",
    "CachePolicy",
    "Eviction",
    "NoRoom",
    "pipelined_seconds",
    "prefix_length",
    "sequential_seconds",
    "uniform_prefix",
    "cache_granularity",
    "cache_key",
    "model_of",
    "per_model",
]
