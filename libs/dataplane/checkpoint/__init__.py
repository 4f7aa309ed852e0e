"""Converted checkpoints: a model component's weights as page-aligned partitions in execution order.

``from_pretrained`` parses safetensors, allocates every tensor and copies into it; a cold start pays
that at ~1 GB/s. A *converted* checkpoint is laid out for the loader (:mod:`libs.dataplane.loader`)
instead: plain partition files that ``O_DIRECT`` reads land in one flat buffer, every tensor a view of
it (no parsing, no copies), checked chunk by chunk with CRC32 as they land.

The package:

- :mod:`~libs.dataplane.checkpoint.format`: where a checkpoint lives, its layout ("Layout",
  "Alignment"), the index structs and constants, reading and verifying (CRC32C per chunk,
  "Integrity"), and the source fingerprint that tells a stale checkpoint;
- :mod:`~libs.dataplane.checkpoint.conversion`: laying a model out, writing partitions and the index,
  converting a component folder (:func:`convert`, :func:`ensure_converted`);
- :mod:`~libs.dataplane.checkpoint.cli`: ``python -m libs.dataplane.checkpoint convert|verify PATH``.

Every public name is importable from here (``from libs.dataplane.checkpoint import ensure_converted``).
torch, diffusers and transformers are imported inside functions: the package's top level stays
importable without them.
"""

from __future__ import annotations

from libs.dataplane.checkpoint.cli import Outcome, component_dirs, convert_tree, main, model_folders
from libs.dataplane.checkpoint.conversion import (
    FORWARD_ORDER_HINTS,
    Planned,
    convert,
    ensure_converted,
    layer_of,
    load_source_model,
    plan_model,
    walk_modules,
    write_checkpoint,
)
from libs.dataplane.checkpoint.format import (
    ADDRESS_MODULUS,
    CACHE_ENV,
    CKPT_DIRNAME,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PARTITION_BYTES,
    FORMAT_VERSION,
    INDEX_NAME,
    LIBRARIES,
    NATIVE,
    PAGE,
    WEIGHT_SUFFIXES,
    Index,
    LayerEntry,
    ModelInfo,
    PartitionEntry,
    Source,
    SourceFile,
    TensorEntry,
    check_sizes,
    checkpoint_cache,
    checkpoint_dir,
    checkpoint_id,
    checkpoint_root,
    checksum,
    class_id,
    dtype_name,
    has_weights,
    hub_snapshot,
    problem,
    read_index,
    resolve_class,
    source_files,
    source_of,
    verify,
)

__all__ = [
    "ADDRESS_MODULUS",
    "CKPT_DIRNAME",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_PARTITION_BYTES",
    "FORMAT_VERSION",
    "FORWARD_ORDER_HINTS",
    "INDEX_NAME",
    "LIBRARIES",
    "NATIVE",
    "PAGE",
    "WEIGHT_SUFFIXES",
    "Index",
    "LayerEntry",
    "ModelInfo",
    "PartitionEntry",
    "Planned",
    "Source",
    "SourceFile",
    "TensorEntry",
    "CACHE_ENV",
    "Outcome",
    "check_sizes",
    "checkpoint_cache",
    "checkpoint_root",
    "convert_tree",
    "hub_snapshot",
    "model_folders",
    "checkpoint_dir",
    "checkpoint_id",
    "checksum",
    "class_id",
    "component_dirs",
    "convert",
    "dtype_name",
    "ensure_converted",
    "has_weights",
    "layer_of",
    "load_source_model",
    "main",
    "plan_model",
    "problem",
    "read_index",
    "resolve_class",
    "source_files",
    "source_of",
    "verify",
    "walk_modules",
    "write_checkpoint",
]
