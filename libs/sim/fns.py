"""Generic ModelFns with the shape of a diffusion workflow, for simulated executors.

A simulated executor never calls ``execute``: it sleeps for the profiled time of the node's
*model* (``paper-h800.json`` keys such as ``flux1-dev/dit``). The classes still implement
``execute`` with tiny tensors, so the same workflows also run on a real executor (a smoke test of
the control plane without model weights). No torch at import time, as for every ModelFn.
"""

from __future__ import annotations

from typing import Any

from libs.workflow.modelfn import ModelFn


class SimTextEncoder(ModelFn):
    """All text encoders of a workflow as one call (CLIP-L + bigG + T5 for SD3; CLIP-L + T5 for Flux)."""

    fn_name = "sim.text_encoder"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_output("prompt_embeds")

    def execute(self, components: dict[str, Any], prompt: str, **_: Any) -> dict[str, Any]:
        import torch

        return {"prompt_embeds": torch.full((1, 8), float(len(prompt)))}


class SimPrepareLatents(ModelFn):
    fn_name = "sim.prepare_latents"

    def setup_io(self) -> None:
        self.add_input("seed")
        self.add_output("latents")

    def execute(self, components: dict[str, Any], seed: int, **_: Any) -> dict[str, Any]:
        import torch

        return {"latents": torch.randn((1, 16), generator=torch.Generator().manual_seed(seed))}


class SimDenoiser(ModelFn):
    """One denoising step: the diffusion model call plus the scheduler step.

    Optional inputs, bound by name when a workflow has them in scope: ``control`` (a ControlNet's
    residuals, a callback input as in the real families: the step may start once the ControlNet
    has started, paper §5.2) and ``lora_delta`` (an unfused LoRA's per-step work, an ordinary input:
    its cost adds to the step's). Plain workflows leave both unbound."""

    fn_name = "sim.denoiser"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("prompt_embeds")
        self.add_input("step")
        self.add_input("control", callback=True, optional=True)
        self.add_input("lora_delta", optional=True)
        self.add_output("latents")

    def execute(
        self,
        components: dict[str, Any],
        latents: Any,
        prompt_embeds: Any,
        step: int,
        control: Any = None,
        lora_delta: Any = None,
        **_: Any,
    ) -> dict[str, Any]:
        out = latents * 0.9 + prompt_embeds.mean() * 0.01 + step * 1e-3
        if control is not None:
            out = out + (control() if callable(control) else control) * 1e-3
        if lora_delta is not None:
            out = out + lora_delta * 1e-3
        return {"latents": out}


class SimControlNet(ModelFn):
    """One ControlNet call per step; its residuals feed the step's denoiser (``control``)."""

    fn_name = "sim.controlnet"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("prompt_embeds")
        self.add_input("step")
        self.add_output("control")

    def execute(
        self, components: dict[str, Any], latents: Any, prompt_embeds: Any, step: int, **_: Any
    ) -> dict[str, Any]:
        return {"control": latents * 0.5 + prompt_embeds.mean() * 0.01 + step * 1e-3}


class SimLora(ModelFn):
    """An unfused LoRA's extra work in one step (its own weights, its own profiled time); its output
    feeds the step's denoiser (``lora_delta``), so the base DiT stays one shared model."""

    fn_name = "sim.lora"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("step")
        self.add_output("lora_delta")

    def execute(self, components: dict[str, Any], latents: Any, step: int, **_: Any) -> dict[str, Any]:
        return {"lora_delta": latents * 0.1 + step * 1e-3}


class SimVaeDecode(ModelFn):
    fn_name = "sim.vae_decode"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_output("image")

    def execute(self, components: dict[str, Any], latents: Any, **_: Any) -> dict[str, Any]:
        import torch

        value = int((latents.abs().mean().item() * 255) % 256)
        return {"image": torch.full((8, 8, 3), value, dtype=torch.uint8)}


# Every simulated ModelFn, for catalogs built without entry points (tests) and for pyproject.toml.
MODELFNS: list[type[ModelFn]] = [
    SimTextEncoder,
    SimPrepareLatents,
    SimDenoiser,
    SimControlNet,
    SimLora,
    SimVaeDecode,
]
