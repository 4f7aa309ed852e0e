"""Profiles for simulated executors: per-model load and compute times, each number with its source.

A profile is JSON. Every figure is ``{"value": 0.235, "tag": "M", "source": "..."}`` where the tag
says how it was obtained (``docs/profiles.md`` lists the figures and their sources): **M** measured in a public source,
**D** derived (the source says how), **P** chosen to match a ratio the paper states. Models are
keyed by the ``model`` reference workflow specs use, so a spec written for simulation names the
same models a real deployment would load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

PROFILES = Path(__file__).parent / "profiles"


class Figure(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    value: float
    tag: Literal["M", "D", "P"]
    source: str


class ModelProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    size_gb: Figure  # weights resident on the device
    load_s: Figure  # host memory -> device, when not resident
    exec_s: Figure  # one call
    output_bytes: int = 262144  # size of each output tensor (data-plane metadata only)


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    device: str  # the accelerator the numbers describe
    gpu_memory_gb: Figure  # capacity for cached weights (LRU beyond it)
    models: dict[str, ModelProfile]
    transfer_gb_s: Figure | None = None  # executor-to-executor tensor bandwidth

    def model(self, name: str) -> ModelProfile | None:
        return self.models.get(name)


def load_profile(path_or_name: str | Path) -> Profile:
    """A profile by file path, or by name from the shipped ``profiles/`` folder."""
    path = Path(path_or_name)
    if not path.exists():
        path = PROFILES / f"{path_or_name}.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=Profile)
    except FileNotFoundError:
        shipped = sorted(p.stem for p in PROFILES.glob("*.json"))
        raise FileNotFoundError(f"no profile {path_or_name!r} (a path, or one of {shipped})") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"profile {path}: {e}") from None
