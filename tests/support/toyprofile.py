"""A simulation profile of one instant model (``m``), for tests of simulated executors."""

from __future__ import annotations

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
