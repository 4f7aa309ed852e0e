"""Where model references in specs point on an executor."""

from __future__ import annotations

import os
import re
from pathlib import Path

# A Hub id as workflows name one: ``org/name``, optionally ``@revision`` (a branch, tag or commit).
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


def resolve_model_path(model: str, root: Path | str) -> str:
    """A spec's model (or LoRA) reference -> what ``from_pretrained`` / a loader gets.

    Absolute paths are used as they are; a name found under the model root
    (``T2I_EXECUTOR_MODEL_ROOT``) is that file or folder; a Hub id (``org/name[@revision]``) held
    in the local Hugging Face cache is its snapshot folder (:func:`hub_snapshot_path`), which then
    converts and loads like any folder. Anything else is passed through (a Hub id not in the
    cache, for ``from_pretrained`` on a machine that can reach the hub).
    """
    if not model or os.path.isabs(model):
        return model
    local = Path(root) / model
    if local.exists():
        return str(local)
    return hub_snapshot_path(model) or model


def hub_snapshot_path(model: str) -> str | None:
    """The snapshot folder of Hub id ``org/name[@revision]`` in the local Hugging Face cache
    (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``: ``models--org--name/snapshots/<commit>/``, the
    revision resolved through ``refs/``), without any network access; None when it is not there,
    ``model`` is no Hub id, or huggingface_hub is not installed (the control plane)."""
    m = HUB_ID.match(model)
    if m is None:
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        cache = os.environ.get("HF_HUB_CACHE") or (
            os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None
        )  # read at each call (huggingface_hub reads its own once, at import)
        return str(
            snapshot_download(m["repo"], revision=m["revision"], cache_dir=cache, local_files_only=True)
        )
    except Exception:  # noqa: BLE001 - not in the cache (LocalEntryNotFoundError), or a bad revision
        return None


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
