"""Torch-free ModelFns with the shape of a Flux workflow, for tests of composition and the DAG."""

from __future__ import annotations

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


TOYS = [Encode, Prepare, Denoiser, Step, Decode, Control, ControlledDenoiser]
CATALOG: dict[str, Signature] = {c.fn_name: c.signature() for c in TOYS}

PARAMS = {
    "prompt": ParamSpec(type="str", required=True, max_length=100),
    "seed": ParamSpec(type="int", default=0, minimum=0),
    "num_inference_steps": ParamSpec(type="int", default=3, minimum=1, maximum=50),
    "guidance_scale": ParamSpec(type="float", default=3.5, minimum=0.0, maximum=20.0),
}
