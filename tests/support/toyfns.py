"""Torch-free ModelFns with the shape of a Flux workflow, for tests of composition and the DAG,
and a few that run (importing torch inside ``execute``) for tests of the executor's node runner."""

from __future__ import annotations

from typing import Any

from libs.workflow.modelfn import ModelFn, Signature
from libs.workflow.spec import ParamSpec


class Encode(ModelFn):
    fn_name = "toy.encode"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_output("prompt_embeds")


class Prepare(ModelFn):
    fn_name = "toy.prepare"

    def setup_io(self) -> None:
        self.add_input("seed")
        self.add_output("latents")
        self.add_output("timesteps")


class Denoiser(ModelFn):
    fn_name = "toy.denoiser"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("prompt_embeds")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_output("noise_pred")


class Step(ModelFn):
    fn_name = "toy.step"

    def setup_io(self) -> None:
        self.add_input("noise_pred")
        self.add_input("latents")
        self.add_input("step")
        self.add_output("latents")


class Decode(ModelFn):
    fn_name = "toy.decode"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_output("image")


class Control(ModelFn):
    fn_name = "toy.control"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("prompt_embeds")
        self.add_output("control_outputs")


class ControlledDenoiser(ModelFn):
    fn_name = "toy.controlled_denoiser"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("prompt_embeds")
        self.add_input("control_outputs", callback=True)
        self.add_output("noise_pred")


class _Runnable(ModelFn):
    """Loads nothing, and records the device it was loaded for (``load_model(path, device)``)."""

    def load_model(self, model_path: str, device: str) -> dict[str, Any]:
        return {"path": model_path, "device": device}


class Pair(_Runnable):
    """Two outputs: ``first`` (a list of two tensors) and ``second``, whose ``mode`` input can break it:
    ``"ok"``, ``"none"`` (no tensor), ``"huge"`` (larger than any test arena), ``"float"`` (not an image)."""

    fn_name = "toy.pair"

    def setup_io(self) -> None:
        self.add_input("x")
        self.add_input("mode")
        self.add_output("first")
        self.add_output("second")

    def execute(self, components: dict[str, Any], x: Any, mode: str) -> dict[str, Any]:
        import torch

        second = {
            "ok": lambda: (x * 3).to(torch.uint8).reshape(1, -1, 1, 3),
            "none": lambda: None,
            "huge": lambda: torch.zeros(1 << 20),
            "float": lambda: x * 3,
        }[mode]()
        return {"first": [x + 1, x + 2], "second": second}


class Crash(_Runnable):
    """Reads its inputs (``z``, optional, is a callback input), then raises: a ModelFn bug."""

    fn_name = "toy.crash"

    def setup_io(self) -> None:
        self.add_input("x")
        self.add_input("y")
        self.add_input("z", callback=True, optional=True)
        self.add_output("out")

    def execute(self, components: dict[str, Any], x: Any, y: Any, z: Any = None) -> dict[str, Any]:
        float((x.sum() + y.sum() + (z().sum() if z is not None else 0)).item())
        raise RuntimeError("boom")


TOYS = [Encode, Prepare, Denoiser, Step, Decode, Control, ControlledDenoiser]
CATALOG: dict[str, Signature] = {c.fn_name: c.signature() for c in TOYS}

PARAMS = {
    "prompt": ParamSpec(type="str", required=True, max_length=100),
    "seed": ParamSpec(type="int", default=0, minimum=0),
    "num_inference_steps": ParamSpec(type="int", default=3, minimum=1, maximum=50),
    "guidance_scale": ParamSpec(type="float", default=3.5, minimum=0.0, maximum=20.0),
}
