"""The built-in workflow catalog (paper setting S2): model families x {basic, +ControlNet, +LoRA, +both}.

Families: Stable Diffusion 1.5 (UNet, CFG), SD3 (three text encoders, CFG), Flux dev (guidance
embedding) and schnell, and Sana (a DiT with its own ControlNet). Each family module provides its
ModelFns, a builder of random-weight components (``build(out_root)``) and its workflows. Setting up
means building every family under one model root (``python -m libs.models.build --all``) and
registering the workflows and the LoRA adapters (``make run`` does both).

This module imports no torch; the builders import it when called.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from libs.workflow.spec import WorkflowSpec

# family -> (workflows module, builder module); workflows modules expose workflows(), builders build().
FAMILIES: dict[str, tuple[str, str]] = {
    "flux": ("libs.models.workflows", "libs.models.tiny"),
    "sd15": ("libs.models.sd_workflows", "libs.models.tiny_sd"),
    "sd3": ("libs.models.sd3_workflows", "libs.models.tiny_sd3"),
    "sana": ("libs.models.sana_workflows", "libs.models.tiny_sana"),
}

# LoRA adapters the builders write, registered under these names (paths relative to the model root).
LORAS: dict[str, str] = {
    "tiny-sd15-style": "loras/tiny-sd15-style.safetensors",
    "tiny-sd3-style": "loras/tiny-sd3-style.safetensors",
    "tiny-flux-style": "loras/tiny-flux-style.safetensors",
    "tiny-sana-style": "loras/tiny-sana-style.safetensors",
}


def workflows() -> list[WorkflowSpec]:
    """Every catalog workflow, family by family."""
    out: list[WorkflowSpec] = []
    for wf_module, _ in FAMILIES.values():
        module = importlib.import_module(wf_module)
        fn = getattr(module, "workflows", None) or module.flux_workflows
        out.extend(fn())
    return out


def build(out_root: str | Path) -> dict[str, Path]:
    """Build every family's random-weight components under ``out_root`` (idempotent)."""
    built: dict[str, Path] = {}
    for _, builder in FAMILIES.values():
        built.update(importlib.import_module(builder).build(out_root))
    return built
