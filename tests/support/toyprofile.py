"""A simulation profile of one instant model (``m``), for tests of simulated executors."""

from __future__ import annotations

import json
from pathlib import Path

from libs.sim.profile import Figure, ModelProfile, Profile


def _fig(value: float) -> Figure:
    return Figure(value, "P", "test")


PROFILE = Profile(
    name="test",
    description="one tiny model that loads and runs in no time",
    device="sim",
    gpu_memory_gb=_fig(10),
    models={"m": ModelProfile(size_gb=_fig(1), load_s=_fig(0.0), exec_s=_fig(0.0), output_bytes=4096)},
)


def write_family_profile(path: Path, dits: dict[str, float], *, load_s: float = 0.001) -> None:
    """A profile file of one sim family per ``dits`` entry (family -> seconds per denoising step),
    each with ``text``, ``prepare``, ``dit`` and ``vae`` models, for ``sim_workflow(..., family)``."""
    models = {}
    for fam, dit in dits.items():
        for part, exec_s in (("text", 0.001), ("prepare", 0.001), ("dit", dit), ("vae", 0.002)):
            models[f"{fam}/{part}"] = {
                "size_gb": _raw(0.1),
                "load_s": _raw(load_s),
                "exec_s": _raw(exec_s),
                "output_bytes": 1024,
            }
    profile = {"name": path.stem, "description": "test profile", "device": "sim", "gpu_memory_gb": _raw(80)}
    path.write_text(json.dumps({**profile, "models": models}))


def _raw(value: float) -> dict:
    return {"value": value, "tag": "D", "source": "test profile"}
