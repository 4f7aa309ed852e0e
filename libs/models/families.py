"""The built-in model families and their workflow catalog (the paper's setting S2): every family x
{basic, +ControlNet, +LoRA, +both}.

Families: Stable Diffusion 1.5 (UNet, CFG), SD3 (three text encoders, CFG), Flux dev (guidance
embedding) and schnell, Sana (a DiT with its own ControlNet) and Z-Image with Z-Image-Turbo (a
Qwen3 encoder, a single-stream DiT whose ControlNet borrows its refiners). Every family ``f`` is
four modules of one naming scheme:

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
    ``lora`` the adapter its builder writes (registered under that name).

    ``device_dtypes`` is the dtype the family runs at by default per device type, as users run its
    diffusers pipeline (``torch_dtype=`` in the reference examples): bf16 for Flux, SD3/3.5 and Sana
    on CUDA, fp16 for SD 1.5. A device type not listed (the CPU) loads as ``from_pretrained`` does
    without ``torch_dtype``, so the tiny CPU catalog stays fp32 and bitwise equal to diffusers.
    ``classes`` are the prefixes of the pipeline and model class names of the family's checkpoints
    (``model_index.json``'s ``_class_name``, a component's ``config.json``), the longest match wins."""

    name: str
    lora: str
    device_dtypes: tuple[tuple[str, str], ...] = ()
    classes: tuple[str, ...] = ()

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
        Family("flux", "tiny-flux-style", (("cuda", "bfloat16"),), ("Flux",)),
        Family(
            "sd",
            "tiny-sd15-style",
            (("cuda", "float16"),),
            ("StableDiffusion", "ControlNetModel", "UNet2DConditionModel"),
        ),  # fmt: skip
        Family("sd3", "tiny-sd3-style", (("cuda", "bfloat16"),), ("StableDiffusion3", "SD3")),
        Family("sana", "tiny-sana-style", (("cuda", "bfloat16"),), ("Sana",)),
        Family("zimage", "tiny-zimage-style", (("cuda", "bfloat16"),), ("ZImage",)),
        Family("flux2", "tiny-flux2-style", (("cuda", "bfloat16"),), ("Flux2",)),
        Family("qwenimage", "tiny-qwenimage-style", (("cuda", "bfloat16"),), ("QwenImage",)),
    )
}


def family_of_fn(fn_name: str) -> Family | None:
    """The built-in family of a ModelFn name (``sd3.transformer`` -> sd3), None for others."""
    return FAMILIES.get(fn_name.partition(".")[0])


def family_of_class(class_name: str) -> Family | None:
    """The family of a pipeline or model class name (``StableDiffusion3Pipeline`` -> sd3), by the
    longest prefix any family claims; None when no family claims it."""
    best: tuple[int, Family | None] = (0, None)
    for f in FAMILIES.values():
        for prefix in f.classes:
            if class_name.startswith(prefix) and len(prefix) > best[0]:
                best = (len(prefix), f)
    return best[1]


def device_dtype(family: Family | None, device: str) -> str | None:
    """The family's default dtype on ``device`` (``"cuda:1"`` -> its ``cuda`` entry); None: load as
    ``from_pretrained`` does."""
    if family is None:
        return None
    return dict(family.device_dtypes).get(device.partition(":")[0])


# LoRA adapters the builders write, registered under these names (paths relative to the model root).
LORAS: dict[str, str] = {f.lora: f.lora_path for f in FAMILIES.values()}


def workflows() -> list[WorkflowSpec]:
    """Every catalog workflow, family by family, then the trained models' (:mod:`libs.trained`)."""
    from libs.trained import catalog as trained

    return [
        spec for f in FAMILIES.values() for spec in f.module("workflows").workflows()
    ] + trained.workflows()


def build(out_root: str | Path) -> dict[str, Path]:
    """Build every family's random-weight components under ``out_root`` (idempotent), and copy the
    committed trained checkpoints there (:func:`libs.trained.catalog.install`)."""
    from libs.trained import catalog as trained

    built: dict[str, Path] = {}
    for f in FAMILIES.values():
        built.update(f.module("builder").build(out_root))
    built.update(trained.install(out_root))
    return built


DTYPES = frozenset({"float32", "float16", "bfloat16"})


def parse_dtypes(raw: str) -> dict[str, str]:
    """``T2I_EXECUTOR_DTYPES``: ``"model=bfloat16,*=float16"`` -> ``{"model": "bfloat16", "*": ...}``."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        model, sep, dtype = item.partition("=")
        if not sep or not model.strip() or dtype.strip() not in DTYPES:
            raise ValueError(
                f"T2I_EXECUTOR_DTYPES: {item!r} is not 'model=dtype' with dtype in {sorted(DTYPES)}"
            )
        out[model.strip()] = dtype.strip()
    return out
