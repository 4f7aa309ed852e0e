"""The workflows of the paper's evaluation settings S1 and S2 (ServerlessT2I, arXiv 2607.26566, §8.1,
Table 1), for simulated executors with ``profiles/paper-s.json``.

* **S1**: five basic workflows (SD3.5-Large, Z-Image, Z-Image-Turbo, Flux1-dev, Flux2-Klein-4B):
  text encoders -> diffusion model once per step -> VAE decode.
* **S2**: twenty workflows on the six base models (S1's five plus Flux1-schnell): each plain, each
  with a LoRA, four with a ControlNet, two with a ControlNet and a LoRA, and two more LoRAs.

Composition follows the real families (``libs/models/*_workflows.py``): a ControlNet node runs once
per step and feeds the step's denoiser through a callback input (``control``); a LoRA is an
adapter on the shared base model, simulated as its own per-step node (its weights, +10% of the
step's time) whose output feeds the denoiser (``lora_delta``). Components that are the same
weights share one model key (``flux1/text``, ``qwen3-4b/text``, ``flux1/vae``, the Flux ControlNet),
so a model cache shares them across workflows.

:func:`solo_latency` gives what a request of a workflow costs alone, from the profile: every model
resident (``warm``), everything loaded first (``cold``), on one GPU (``serial``) and along the
DAG's critical path (``critical``). Deadlines are ``SLO scale x solo latency`` (:mod:`libs.sim.trace`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from libs.sim.fns import (
    MODELFNS,
    SimControlNet,
    SimDenoiser,
    SimLora,
    SimPrepareLatents,
    SimTextEncoder,
    SimVaeDecode,
)
from libs.sim.profile import ModelProfile, Profile, load_profile
from libs.workflow.compose import Value, Workflow
from libs.workflow.dag import Dag, unroll
from libs.workflow.modelfn import Signature
from libs.workflow.spec import ParamSpec, WorkflowSpec
from libs.workflow.validate import validate_spec

PROFILE = "paper-s"
PREPARE = "prepare"


@dataclass(frozen=True)
class Base:
    """A base model: its components' model keys and default DiT calls (docs/profiles.md)."""

    name: str
    text: str
    dit: str
    vae: str
    steps: int
    controlnet: str = ""  # the ControlNet its ControlNet variants use ("" = none in S2)
    # The catalog workflow of the same architecture (libs/models/*_workflows.py, tiny random
    # weights), which a real checkpoint of this model runs through: what this simulated one stands for.
    real: str = ""


BASES: dict[str, Base] = {
    b.name: b
    for b in (
        Base(
            "sd3.5-large", "sd3/text", "sd3.5-large/dit", "sd3/vae", 28, "sd3.5-large/controlnet", "tiny-sd3"
        ),
        Base("z-image", "qwen3-4b/text", "z-image/dit", "z-image/vae", 50, real="tiny-zimage"),
        Base(
            "z-image-turbo",
            "qwen3-4b/text",
            "z-image-turbo/dit",
            "z-image/vae",
            8,
            "z-image-turbo/controlnet",
            "tiny-zimage-turbo",
        ),
        Base(
            "flux1-dev", "flux1/text", "flux1-dev/dit", "flux1/vae", 28, "flux1/controlnet-union", "tiny-flux"
        ),
        Base(
            "flux1-schnell",
            "flux1/text",
            "flux1-schnell/dit",
            "flux1/vae",
            4,
            "flux1/controlnet-union",
            "tiny-flux-schnell",
        ),
        Base(
            "flux2-klein-4b", "qwen3-4b/text", "flux2-klein-4b/dit", "flux2/vae", 4, real="tiny-flux2-klein"
        ),
    )
}


def eval_workflow(base: str, *, controlnet: bool = False, lora: str = "") -> WorkflowSpec:
    """``base``'s workflow, optionally with its ControlNet and/or the LoRA ``<base>/lora-<lora>``.

    Named ``eval-<base>[-cn][-lora-<x>]``."""
    b = BASES[base]
    if controlnet and not b.controlnet:
        raise ValueError(f"{base} has no ControlNet in the profile")
    name = f"eval-{base}" + ("-cn" if controlnet else "") + (f"-lora-{lora}" if lora else "")
    parts = ["ControlNet" if controlnet else "", f"LoRA {lora}" if lora else ""]
    extra = " + ".join(p for p in parts if p)
    params = {
        "prompt": ParamSpec(type="str", required=True, max_length=4000),
        "seed": ParamSpec(type="int", default=0, minimum=0),
        "num_inference_steps": ParamSpec(type="int", default=b.steps, minimum=1, maximum=100),
    }
    text = SimTextEncoder(b.text, id="text")
    prepare = SimPrepareLatents(PREPARE, id="prepare")
    dit = SimDenoiser(b.dit, id="dit")
    cn = SimControlNet(b.controlnet, id="controlnet") if controlnet else None
    adapter = SimLora(f"{base}/lora-{lora}", id="lora") if lora else None
    vae = SimVaeDecode(b.vae, id="vae")
    description = f"{base} basic workflow" + (f" + {extra}" if extra else "") + " (simulated, paper-s)"
    with Workflow(name, params=params, description=description) as wf:
        text()
        init = prepare()

        def denoise(step: Value, latents: Value) -> Value:
            if cn is not None:
                cn(latents=latents)  # "control": bound by name into the denoiser (a callback input)
            if adapter is not None:
                adapter(latents=latents)  # "lora_delta": bound by name into the denoiser
            return dit(latents=latents)

        latents = wf.loop("num_inference_steps", denoise, id="denoise", latents=init)
        wf.output("image", vae(latents=latents))
    return wf.spec()


S1_BASES = ["sd3.5-large", "z-image", "z-image-turbo", "flux1-dev", "flux2-klein-4b"]
S2_VARIANTS: list[tuple[str, bool, str]] = [
    *((b, False, "") for b in BASES),  # the six plain workflows
    *((b, False, "a") for b in BASES),  # one LoRA each
    ("sd3.5-large", True, ""),
    ("z-image-turbo", True, ""),
    ("flux1-dev", True, ""),
    ("flux1-schnell", True, ""),
    ("flux1-dev", True, "a"),
    ("z-image-turbo", True, "a"),
    ("flux1-dev", False, "b"),
    ("z-image-turbo", False, "b"),
]


def s1() -> list[WorkflowSpec]:
    return [eval_workflow(b) for b in S1_BASES]


def s2() -> list[WorkflowSpec]:
    return [eval_workflow(b, controlnet=c, lora=lo) for b, c, lo in S2_VARIANTS]


SETTINGS: dict[str, Callable[[], list[WorkflowSpec]]] = {"s1": s1, "s2": s2}


def setting(name: str) -> list[WorkflowSpec]:
    return SETTINGS[name]()


# -- what a workflow costs alone ---------------------------------------------------------------


@dataclass(frozen=True)
class Solo:
    """Seconds one request takes alone on simulated H800s (profile figures, no contention).

    ``serial``: one GPU runs every node in turn, every model resident (a monolithic pipeline's
    inference latency: what deadlines use by default). ``critical``: the DAG's critical path with
    unlimited GPUs, every model resident (a ControlNet overlaps its step's denoiser, as the callback
    input allows). ``cold_serial`` / ``cold_critical``: the same with every model loaded from host
    memory first, one after another at the profile's bandwidth, in order of first use, nothing
    cached and no layer-wise overlap (a NoCache cold start)."""

    serial: float
    critical: float
    cold_serial: float
    cold_critical: float


def models_of(spec: WorkflowSpec) -> list[str]:
    """The distinct model keys ``spec`` uses, in order of first use."""
    dag = _dag(spec)
    return list(dict.fromkeys(n.model for n in dag.nodes.values()))


def solo_latency(spec: WorkflowSpec, profile: Profile | None = None) -> Solo:
    profile = profile or load_profile(PROFILE)
    dag = _dag(spec)
    exec_s = {nid: _model(profile, n.model).exec_s.value for nid, n in dag.nodes.items()}
    loaded: dict[str, float] = {}  # model -> when its cold load finishes (loads back to back)
    t = 0.0
    for n in dag.nodes.values():
        if n.model not in loaded:
            t += _model(profile, n.model).load_s.value
            loaded[n.model] = t
    total_load = t

    def critical(cold: bool) -> float:
        start: dict[str, float] = {}
        end: dict[str, float] = {}
        for nid, n in dag.nodes.items():  # topological order
            s = max([end[d] for d in n.deps] + [start[d] for d in n.cb_deps] + [0.0])
            if cold:
                s = max(s, loaded[n.model])
            start[nid], end[nid] = s, s + exec_s[nid]
        return max(end.values())

    serial = sum(exec_s.values())
    return Solo(serial, critical(False), total_load + serial, critical(True))


def solo_latencies(specs: list[WorkflowSpec], profile: Profile | None = None) -> dict[str, Solo]:
    profile = profile or load_profile(PROFILE)
    return {s.name: solo_latency(s, profile) for s in specs}


def workflow_bytes(spec: WorkflowSpec, profile: Profile | None = None) -> dict[str, int]:
    """Bytes of each model ``spec`` uses (profile sizes, GB = 10^9 bytes)."""
    profile = profile or load_profile(PROFILE)
    return {m: round(_model(profile, m).size_gb.value * 1e9) for m in models_of(spec)}


def _model(profile: Profile, key: str) -> ModelProfile:
    m = profile.model(key)
    if m is None:
        raise KeyError(f"model {key!r} is not in profile {profile.name!r}")
    return m


def catalog() -> dict[str, Signature]:
    """Signatures of the simulated ModelFns (what the entry-point catalog lists once installed)."""
    return {c.fn_name: c.signature() for c in MODELFNS}


def _dag(spec: WorkflowSpec) -> Dag:
    """One request of ``spec`` with its default parameters, unrolled."""
    sigs = catalog()
    spec = validate_spec(spec, sigs)
    params = {n: ("x" if p.required else p.default) for n, p in spec.params.items()}
    callbacks = {n: frozenset(k for k, cb in s.inputs.items() if cb) for n, s in sigs.items()}
    return unroll(spec, params, callbacks=callbacks)
