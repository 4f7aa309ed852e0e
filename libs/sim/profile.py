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
    # Uniform layers the weights split into (docs/profiles.md, Layers): each holds size/layers, loads
    # in load_s/layers and computes in exec_s/layers, so a prefix of them can stay resident and the
    # rest load while the first compute (paper §5.1, libs.dataplane.weights).
    layers: int = 1
    # Bytes of each layer, when they are known (a profile measured from real checkpoints): then the
    # layers are these (``layers`` is ignored) and each loads in its share of load_s by size.
    layer_bytes: list[int] = []

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if any(b < 0 for b in self.layer_bytes):
            raise ValueError("layer_bytes must be >= 0")


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    device: str  # the accelerator the numbers describe
    gpu_memory_gb: Figure  # capacity for cached weights (evicted layer by layer beyond it)
    models: dict[str, ModelProfile]
    transfer_gb_s: Figure | None = None  # executor-to-executor tensor bandwidth
    # The share of the (simulated) arena that cached weights may use once the GPU budget is full;
    # communication takes it back whenever it needs the space (paper §5.3).
    arena_weights: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.arena_weights <= 1.0:
            raise ValueError(f"arena_weights must be in [0, 1], got {self.arena_weights}")

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
