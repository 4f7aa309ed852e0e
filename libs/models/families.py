"""The built-in model families and their workflow catalog (the paper's setting S2): every family x
{basic, +ControlNet, +LoRA, +both}.

Families: Stable Diffusion 1.5 (UNet, CFG), SD3 (three text encoders, CFG), Flux dev (guidance
embedding) and schnell, and Sana (a DiT with its own ControlNet). Every family ``f`` is four modules
of one naming scheme:

* ``libs.models.f``: the ModelFns of the base pipeline (what ``f.*`` entry points name);
* ``libs.models.f_controlnet``: the ModelFns only its ControlNet pipeline has;
* ``libs.models.f_workflows``: ``MODELFNS`` (both modules' classes) and ``workflows()``, the
  family's workflows composed on its tiny models' names;
* ``libs.models.tiny_f``: ``build(out_root)``, a builder of random-weight components (pipeline
  folders, ControlNet, LoRA adapter) returning their paths by name.

Setting up means building every family under one model root (``python -m libs.models.build --all``)
and registering the workflows and the LoRA adapters (``make run`` does both). (Not to be confused
with :mod:`libs.workflow.catalog`, the installed ModelFn classes found through entry points.)

This module imports no torch; the builders import it when called.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from libs.workflow.spec import WorkflowSpec


@dataclass(frozen=True)
class Family:
    """One model family: ``name`` is its module stem and ModelFn prefix (``sd`` -> ``sd.unet``),
    ``lora`` the adapter its builder writes (registered under that name)."""

    name: str
    lora: str

    @property
    def modules(self) -> dict[str, str]:
        """The family's modules by role: base ModelFns, ControlNet ModelFns, workflows, builder."""
        f = self.name
        return {
            "modelfns": f"libs.models.{f}",
            "controlnet": f"libs.models.{f}_controlnet",
            "workflows": f"libs.models.{f}_workflows",
            "builder": f"libs.models.tiny_{f}",
        }

    def module(self, role: str) -> ModuleType:
        return importlib.import_module(self.modules[role])

    @property
    def lora_path(self) -> str:
        """Where the builder writes the LoRA, relative to the model root."""
        return f"loras/{self.lora}.safetensors"


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("flux", lora="tiny-flux-style"),
        Family("sd", lora="tiny-sd15-style"),
        Family("sd3", lora="tiny-sd3-style"),
        Family("sana", lora="tiny-sana-style"),
    )
}

# LoRA adapters the builders write, registered under these names (paths relative to the model root).
LORAS: dict[str, str] = {f.lora: f.lora_path for f in FAMILIES.values()}


def workflows() -> list[WorkflowSpec]:
    """Every catalog workflow, family by family."""
    return [spec for f in FAMILIES.values() for spec in f.module("workflows").workflows()]


def build(out_root: str | Path) -> dict[str, Path]:
    """Build every family's random-weight components under ``out_root`` (idempotent)."""
    built: dict[str, Path] = {}
    for f in FAMILIES.values():
        built.update(f.module("builder").build(out_root))
    return built
