"""Convert every model of a models volume (and of a Hugging Face cache) at the dtype executors will
load it at: what a box's ``model-init`` job runs before its executors start::

    python -m libs.models.convert PATH... [--device cuda] [--dtypes "model=bfloat16,*=float16"]

Each pipeline or component folder at or below each ``PATH`` is converted once (again only where its
checkpoint is missing, stale or corrupt; ``--force`` converts anyway), one at a time; a folder that
fails is named and the others still convert (``--keep-going``: exit 0 even then, so the other models
are served). The dtype is the one an executor on ``--device`` picks (:func:`dtype_for`):
``--dtypes`` (``T2I_EXECUTOR_DTYPES``, the executors' own setting) for the model's name, else its
``*`` entry, else the family's default on that device (bf16 for Flux, SD3 and Sana on CUDA, fp16
for SD 1.5; none on the CPU). A model's name is what workflows call it: its path below ``PATH``
(``tiny-flux``), or ``org/name`` for a Hub cache snapshot. Other arguments are those of
``python -m libs.dataplane.checkpoint convert``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from libs.dataplane.checkpoint import hub_snapshot
from libs.dataplane.checkpoint.cli import main as checkpoint_main
from libs.models.families import device_dtype, family_of_class, parse_dtypes


def class_name(folder: Path) -> str:
    """The pipeline's (``model_index.json``) or model's (``config.json``) class name, "" if none."""
    for name, key in (("model_index.json", "_class_name"), ("config.json", "_class_name")):
        path = folder / name
        if path.is_file():
            config = json.loads(path.read_text())
            if config.get(key):
                return str(config[key])
            if config.get("architectures"):
                return str(config["architectures"][0])
    return ""


def model_name(folder: Path, root: Path) -> str:
    """What a workflow calls the model in ``folder``: ``org/name`` for a Hub snapshot, else its path
    relative to ``root`` (the executors' model root)."""
    hub = hub_snapshot(folder)
    if hub is not None:
        return hub[0].removeprefix("models--").replace("--", "/", 1)
    try:
        return folder.relative_to(root).as_posix()
    except ValueError:
        return str(folder)


def dtype_for(device: str, overrides: dict[str, str], roots: list[Path]) -> Callable[[Path], str | None]:
    """folder -> the dtype an executor on ``device`` loads its model at (module docstring)."""

    def pick(folder: Path) -> str | None:
        root = next((r for r in roots if folder == r or r in folder.parents), folder.parent)
        name = model_name(folder, root)
        if name in overrides:
            return overrides[name]
        if "*" in overrides:
            return overrides["*"]
        return device_dtype(family_of_class(class_name(folder)), device)

    return pick


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m libs.models.convert", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=os.environ.get("T2I_EXECUTOR_DEVICE", "cpu"))
    ap.add_argument("--dtypes", default=os.environ.get("T2I_EXECUTOR_DTYPES", ""))
    args, rest = ap.parse_known_args(argv)
    overrides = parse_dtypes(args.dtypes)
    paths = [Path(a).absolute() for a in rest if os.path.isdir(a)]
    return checkpoint_main(["convert", *rest], dtype_for=dtype_for(args.device, overrides, paths))


if __name__ == "__main__":
    sys.exit(main())
