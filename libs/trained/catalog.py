"""The trained shapes model in the catalog: the ``flux-shapes`` workflow and its model folder.

``flux-shapes`` is :func:`libs.models.flux_workflows.flux_workflow` (the platform's ``flux.*``
ModelFns, unchanged) on the model folder ``tiny-flux-shapes`` under the executors' model root,
with the sampling defaults the model was evaluated at: 64x64, :data:`STEPS` steps, T5 prompts of
16 tokens, no guidance (the transformer has no guidance embedding, like schnell).

The weights are committed at ``checkpoints/tiny-flux-shapes`` (trained by
:mod:`libs.trained.train`); :func:`install` copies that folder into a model root (what
``python -m libs.models.build --all`` and so ``make run`` do), marked complete by a manifest that
holds the checkpoint's content hash, so a changed checkpoint is copied again and an unchanged
one is left alone.

No torch at import time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from libs.models import build_utils
from libs.models.flux_workflows import flux_workflow
from libs.workflow.spec import WorkflowSpec

NAME = "flux-shapes"
MODEL = "tiny-flux-shapes"
CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / MODEL
STEPS = 12
SAMPLE_CAPTION = "a red circle on the left on a white background"
DESCRIPTION = (
    "tiny Flux trained on procedural shapes (64x64): captions like "
    f"'{SAMPLE_CAPTION}' (docs/trained-model.md)"
)


def flux_shapes(model: str = MODEL) -> WorkflowSpec:
    return flux_workflow(
        NAME,
        model,
        sizes=["64x64"],
        steps=STEPS,
        max_sequence_length=16,
        guidance_scale=0.0,
        description=DESCRIPTION,
    )


def workflows() -> list[WorkflowSpec]:
    """The trained models' catalog workflows."""
    return [flux_shapes()]


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != build_utils.MANIFEST)


def checkpoint_hash(folder: str | os.PathLike[str] = CHECKPOINT) -> str:
    """sha256 over the folder's files (relative path and content), the manifest excluded."""
    root, digest = Path(folder), hashlib.sha256()
    for path in _files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def install(
    out_root: str | os.PathLike[str], checkpoint: str | os.PathLike[str] = CHECKPOINT
) -> dict[str, Path]:
    """Copy the committed checkpoint to ``out_root / tiny-flux-shapes`` unless it is there already."""
    src = Path(checkpoint)
    if not (src / "model_index.json").is_file():
        raise FileNotFoundError(f"{src} is no pipeline folder (the trained checkpoint is committed there)")
    manifest = {"family": "flux", "trained": MODEL, "sha256": checkpoint_hash(src)}

    def copy(tmp: Path) -> None:
        for path in _files(src):
            dest = tmp / path.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.parent.chmod(0o755)
            shutil.copyfile(path, dest)
            dest.chmod(0o644)

    return {MODEL: build_utils.build_folder(Path(out_root) / MODEL, manifest, copy)}
