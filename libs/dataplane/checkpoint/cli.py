"""The command line of converted checkpoints (run as ``python -m libs.dataplane.checkpoint``)::

    python -m libs.dataplane.checkpoint convert PATH [--dtype bfloat16] [--class NAME]
    python -m libs.dataplane.checkpoint verify PATH

``PATH`` is a component folder (``config.json`` + weights) or a pipeline folder (``model_index.json``:
every component with weights).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path

from libs.dataplane.checkpoint.conversion import convert
from libs.dataplane.checkpoint.format import (
    CKPT_DIRNAME,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PARTITION_BYTES,
    INDEX_NAME,
    has_weights,
    read_index,
    verify,
)
from libs.dataplane.errors import CorruptCheckpoint


def component_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """The component folders with weights under ``path``: itself, or a pipeline's components."""
    p = Path(path)
    if (p / "model_index.json").is_file():
        index = json.loads((p / "model_index.json").read_text())
        return [p / name for name, v in index.items() if isinstance(v, list) and has_weights(p / name)]
    if has_weights(p):
        return [p]
    raise ValueError(f"{p} is neither a component folder (config.json + weights) nor a pipeline folder")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from libs.dataplane import checkpoint

    ap = argparse.ArgumentParser(
        prog="python -m libs.dataplane.checkpoint", description=(checkpoint.__doc__ or "").split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="convert a component or every component of a pipeline folder")
    c.add_argument("path")
    c.add_argument(
        "--dtype", default=None, help="cast to this torch dtype (default: as from_pretrained loads)"
    )
    c.add_argument("--class", dest="cls", default=None, help="model class, e.g. diffusers.AutoencoderKL")
    c.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES >> 20)
    c.add_argument("--partition-mib", type=int, default=DEFAULT_PARTITION_BYTES >> 20)
    v = sub.add_parser("verify", help="check every chunk's CRC32 of converted checkpoints")
    v.add_argument("path", help="a checkpoint folder, a component folder or a pipeline folder")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "convert":
        cls = None
        if args.cls:
            lib, _, name = args.cls.rpartition(".")
            cls = getattr(importlib.import_module(lib or "diffusers"), name)
        for d in component_dirs(args.path):
            out = convert(
                d, cls, args.dtype, chunk_bytes=args.chunk_mib << 20, partition_bytes=args.partition_mib << 20
            )
            index = read_index(out)
            print(
                f"{out}: {len(index.tensors)} tensors, {len(index.layers)} layers, {index.total_bytes} bytes"
            )
        return 0
    p = Path(args.path)
    ckpts = [p] if (p / INDEX_NAME).is_file() else [
        c for d in component_dirs(p) for c in sorted((d / CKPT_DIRNAME).glob("*")) if (c / INDEX_NAME).is_file()
    ]  # fmt: skip
    bad = 0
    for ck in ckpts:
        try:
            verify(ck)
            print(f"{ck}: ok")
        except CorruptCheckpoint as e:
            bad += 1
            print(f"{ck}: CORRUPT: {e}")
    if not ckpts:
        print(f"{p}: no converted checkpoint")
        return 1
    return 1 if bad else 0
