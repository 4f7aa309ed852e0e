"""The workflows of the paper's fairness experiment (§6, Fig. 9-right), for simulated executors.

``sd3-medium-like`` and ``flux1-dev-like``: text encoding, latent preparation, 28 denoising steps,
VAE decode, with the models of ``profiles/paper-h800.json``. Flux1-dev's solo latency comes out
~10x SD3-medium's, the ratio the paper states.
"""

from __future__ import annotations

from libs.sim.fns import SimDenoiser, SimPrepareLatents, SimTextEncoder, SimVaeDecode
from libs.workflow.compose import Value, Workflow
from libs.workflow.spec import ParamSpec, WorkflowSpec


def sim_workflow(name: str, family: str, *, steps: int = 28, description: str = "") -> WorkflowSpec:
    """A basic T2I workflow whose models are ``<family>/text``, ``/dit``, ``/vae`` in the profile."""
    params = {
        "prompt": ParamSpec(type="str", required=True, max_length=4000),
        "seed": ParamSpec(type="int", default=0, minimum=0),
        "num_inference_steps": ParamSpec(type="int", default=steps, minimum=1, maximum=100),
    }
    text = SimTextEncoder(f"{family}/text", id="text")
    prepare = SimPrepareLatents(f"{family}/prepare", id="prepare")
    dit = SimDenoiser(f"{family}/dit", id="dit")
    vae = SimVaeDecode(f"{family}/vae", id="vae")
    with Workflow(name, params=params, description=description) as wf:
        text()
        init = prepare()

        def denoise(step: Value, latents: Value) -> Value:
            return dit(latents=latents)

        latents = wf.loop("num_inference_steps", denoise, id="denoise", latents=init)
        wf.output("image", vae(latents=latents))
    return wf.spec()


def sd3_medium_like() -> WorkflowSpec:
    return sim_workflow("sd3-medium-like", "sd3-medium", description="SD3-medium basic workflow (simulated)")


def flux1_dev_like() -> WorkflowSpec:
    return sim_workflow("flux1-dev-like", "flux1-dev", description="Flux1-dev basic workflow (simulated)")


BUILTIN = {"sd3-medium-like": sd3_medium_like, "flux1-dev-like": flux1_dev_like}
