"""The command line of converted checkpoints (run as ``python -m libs.dataplane.checkpoint``)::

    python -m libs.dataplane.checkpoint convert PATH... [--dtype bfloat16] [--class NAME] [--force]
    python -m libs.dataplane.checkpoint verify PATH

``PATH`` is a component folder (``config.json`` + weights), a pipeline folder (``model_index.json``:
every component with weights) or any folder above them (a models volume, a Hugging Face cache):
``convert`` finds every pipeline and component folder below it (:func:`model_folders`) and converts
them one at a time, each only where its checkpoint is missing, stale or corrupt (``--force``: again).
A folder that fails is named and the others still convert; the exit status is 1 if any failed
(0 with ``--keep-going``, for an init job whose other models should still be served). A ``PATH``
with no model folder in it (a fresh box's empty Hub cache) is said and skipped; 1 if no ``PATH`` had any.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from libs.dataplane.checkpoint.conversion import convert, ensure_converted
from libs.dataplane.checkpoint.format import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PARTITION_BYTES,
    INDEX_NAME,
    checkpoint_root,
    has_weights,
    read_index,
    verify,
)
from libs.dataplane.errors import CorruptCheckpoint

log = logging.getLogger(__package__)


def component_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """The component folders with weights under ``path``: itself, or a pipeline's components."""
    p = Path(path)
    if (p / "model_index.json").is_file():
        index = json.loads((p / "model_index.json").read_text())
        return [p / name for name, v in index.items() if isinstance(v, list) and has_weights(p / name)]
    if has_weights(p):
        return [p]
    raise ValueError(f"{p} is neither a component folder (config.json + weights) nor a pipeline folder")


def model_folders(root: str | os.PathLike[str]) -> list[Path]:
    """Every pipeline folder and every component folder outside a pipeline at or below ``root``,
    sorted by path. Hidden folders (``.t2i-ckpt``, caches) are skipped; a symlinked folder is
    visited once (the Hub cache's snapshots link to blobs, not folders, so they are walked)."""
    found: list[Path] = []
    seen: set[str] = set()

    def visit(d: Path) -> None:
        real = os.path.realpath(d)
        if real in seen:
            return
        seen.add(real)
        if (d / "model_index.json").is_file() or has_weights(d):
            found.append(d)
            return
        try:
            children = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            log.warning("%s: cannot list: %s", d, e)
            return
        for child in children:
            if not child.name.startswith(".") and child.is_dir():
                visit(Path(child.path))

    visit(Path(root))
    return found


class Outcome(NamedTuple):
    """One folder's conversion: its checkpoints, or why it failed."""

    folder: Path
    checkpoints: list[Path]
    error: str | None = None


def convert_tree(
    root: str | os.PathLike[str],
    *,
    dtype: Any = None,
    dtype_for: Callable[[Path], Any] | None = None,
    cls: type | None = None,
    force: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
) -> list[Outcome]:
    """Convert every folder :func:`model_folders` finds under ``root``, one at a time, at ``dtype``
    (or ``dtype_for(folder)`` where given: a family's default), each only if its checkpoint is
    missing or stale (sizes checked; a corrupt chunk is caught, and converted again, when it is
    loaded) unless ``force``. A folder that fails is logged with its error and the walk goes on.
    Empty when ``root`` holds no model folder at all."""
    outcomes = []
    for folder in model_folders(root):
        try:
            want = dtype_for(folder) if dtype_for is not None else dtype
            done = []
            for d in component_dirs(folder):
                if force:
                    out = convert(d, cls, want, chunk_bytes=chunk_bytes, partition_bytes=partition_bytes)
                else:
                    out = ensure_converted(
                        d, cls, want, chunk_bytes=chunk_bytes, partition_bytes=partition_bytes
                    )
                index = read_index(out)
                log.info(
                    "%s: %d tensors, %d layers, %d bytes",
                    out,
                    len(index.tensors),
                    len(index.layers),
                    index.total_bytes,
                )
                done.append(out)
            outcomes.append(Outcome(folder, done))
        except Exception as e:  # noqa: BLE001 - named, and the other folders still convert
            log.error("%s: conversion failed: %s: %s", folder, type(e).__name__, e)
            outcomes.append(Outcome(folder, [], f"{type(e).__name__}: {e}"))
    return outcomes


def main(argv: list[str] | None = None, dtype_for: Callable[[Path], Any] | None = None) -> int:
    """The command line; ``dtype_for`` (folder -> dtype) is the default dtype of ``convert`` where
    ``--dtype`` is not given (``libs.models.convert`` passes the families' defaults)."""
    import argparse

    from libs.dataplane import checkpoint

    ap = argparse.ArgumentParser(
        prog="python -m libs.dataplane.checkpoint", description=(checkpoint.__doc__ or "").split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="convert every component and pipeline folder at or below each PATH")
    c.add_argument("paths", nargs="+", metavar="PATH")
    c.add_argument(
        "--dtype", default=None, help="cast to this torch dtype (default: as from_pretrained loads)"
    )
    c.add_argument("--class", dest="cls", default=None, help="model class, e.g. diffusers.AutoencoderKL")
    c.add_argument("--force", action="store_true", help="convert again even where a checkpoint is up to date")
    c.add_argument("--keep-going", action="store_true", help="exit 0 even if some folders failed (named)")
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
        outcomes: list[Outcome] = []
        empty: list[str] = []
        for path in args.paths:
            done = convert_tree(
                path, dtype=args.dtype, dtype_for=None if args.dtype else dtype_for, cls=cls,
                force=args.force, chunk_bytes=args.chunk_mib << 20, partition_bytes=args.partition_mib << 20,
            )  # fmt: skip
            if not done:  # a fresh box's empty Hub cache, say: nothing to do there
                empty.append(path)
                print(f"{path}: nothing to convert (no pipeline or component folder in it)")
            outcomes += done
        failed = [o for o in outcomes if o.error]
        for o in outcomes:
            print(f"{o.folder}: {'FAILED: ' + o.error if o.error else f'{len(o.checkpoints)} checkpoints'}")
        print(
            f"converted {len(outcomes) - len(failed)} folders, {len(failed)} failed"
            + "".join(f"\n  failed: {o.folder}" for o in failed)
        )
        if len(empty) == len(args.paths):
            return 1  # nothing anywhere: the paths are probably not what the caller meant
        return 1 if failed and not args.keep_going else 0
    p = Path(args.path)
    ckpts = [p] if (p / INDEX_NAME).is_file() else [
        c for d in component_dirs(p) for c in sorted(checkpoint_root(d).glob("*")) if (c / INDEX_NAME).is_file()
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
