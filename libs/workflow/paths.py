"""Where model references in specs point on an executor."""

from __future__ import annotations

import os
from pathlib import Path


def resolve_model_path(model: str, root: Path | str) -> str:
    """A spec's model (or LoRA) reference -> what ``from_pretrained`` / a loader gets.

    Absolute paths are used as they are; a name found under the model root
    (``T2I_EXECUTOR_MODEL_ROOT``) is that file or folder; anything else is passed through (a Hub id
    on a machine that can reach a hub).
    """
    if not model or os.path.isabs(model):
        return model
    local = Path(root) / model
    return str(local) if local.exists() else model


def resolve_lora_path(path: str, root: Path | str) -> str:
    """A registered LoRA's path -> the file under the model root. Raises ValueError for a path
    that is absolute or that resolves (symlinks followed) outside the root: a tenant's LoRA must
    not name an arbitrary file of the executor's machine."""
    if not path or os.path.isabs(path) or path.startswith("~"):
        raise ValueError(f"LoRA path {path!r} must be relative to the model root")
    base = Path(root).resolve()
    full = (base / path).resolve()
    if full != base and base not in full.parents:
        raise ValueError(f"LoRA path {path!r} resolves outside the model root")
    return str(full)
