"""A loop that runs only the last fraction of its count (img2img's ``strength``): composition, the
spec's schema, validation and unrolling (no torch)."""

from __future__ import annotations

import msgspec
import pytest

from libs.workflow.compose import Value, Workflow
from libs.workflow.dag import Const, TensorSource, tail_start, unroll
from libs.workflow.errors import CompositionError, ParamError, SpecError
from libs.workflow.params import resolve_params
from libs.workflow.spec import LoopSpec, ParamSpec, WorkflowSpec, decode_spec, encode_spec
from libs.workflow.validate import validate_spec
from tests.support.toyfns import CATALOG, PARAMS, Decode, Denoiser, Encode, Prepare, Step

STRENGTH = ParamSpec(type="float", default=0.6, minimum=0.0, maximum=1.0)


def compose(rounding: str = "count", strength: ParamSpec = STRENGTH) -> WorkflowSpec:
    enc, prep, den, step, dec = Encode("m"), Prepare("m"), Denoiser("m"), Step("m"), Decode("m")
    with Workflow("toy-img2img", params={**PARAMS, "strength": strength}) as wf:
        enc()
        init = prep()

        def body(step: Value, latents: Value) -> Value:
            return step_fn(noise_pred=den(latents=latents), latents=latents)

        step_fn = step
        latents = wf.loop(
            "num_inference_steps",
            body,
            id="denoise",
            fraction="strength",
            rounding=rounding,
            latents=init.latents,
        )
        wf.output("image", dec(latents=latents))
    return wf.spec()


def steps_of(spec: WorkflowSpec, **given: object) -> list[str]:
    dag = unroll(spec, resolve_params(spec, {"prompt": "a cat", **given}))
    return [n for n in dag.nodes if n.startswith("denoiser@")]


def sd_get_timesteps_start(n: int, strength: float) -> int:
    # StableDiffusionImg2ImgPipeline.get_timesteps
    init_timestep = min(int(n * strength), n)
    return max(n - init_timestep, 0)


def flux_get_timesteps_start(n: int, strength: float) -> int:
    # FluxImg2ImgPipeline / StableDiffusion3Img2ImgPipeline.get_timesteps
    init_timestep = min(n * strength, n)
    return int(max(n - init_timestep, 0))


def test_a_loop_with_a_fraction_unrolls_only_its_last_steps_keeping_their_indices():
    spec = validate_spec(compose(), CATALOG)

    assert steps_of(spec, num_inference_steps=5, strength=0.6) == ["denoiser@2", "denoiser@3", "denoiser@4"]
    dag = unroll(spec, resolve_params(spec, {"prompt": "x", "num_inference_steps": 5, "strength": 0.6}))
    assert dag.nodes["denoiser@2"].inputs["step"] == Const(2)
    assert dag.nodes["denoiser@2"].inputs["latents"] == TensorSource("prepare", "latents")
    assert dag.nodes["decode"].inputs["latents"] == TensorSource("step@4", "latents")
    assert steps_of(spec, num_inference_steps=4, strength=1.0) == [f"denoiser@{i}" for i in range(4)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 10, 28, 50])
@pytest.mark.parametrize("strength", [0.05, 0.1, 0.3, 0.35, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 0.95, 1.0])
def test_both_roundings_are_the_pipelines_get_timesteps(n: int, strength: float):
    assert tail_start(n, strength, "count") == sd_get_timesteps_start(n, strength)
    assert tail_start(n, strength, "start") == flux_get_timesteps_start(n, strength)


def test_the_roundings_differ_where_the_pipelines_do():
    # 4 steps at strength 0.6: SD runs int(2.4) = 2 steps, Flux skips int(1.6) = 1 and runs 3.
    sd, flux = validate_spec(compose("count"), CATALOG), validate_spec(compose("start"), CATALOG)

    assert steps_of(sd, num_inference_steps=4, strength=0.6) == ["denoiser@2", "denoiser@3"]
    assert steps_of(flux, num_inference_steps=4, strength=0.6) == ["denoiser@1", "denoiser@2", "denoiser@3"]


def test_a_strength_that_leaves_no_step_is_a_param_error_naming_it():
    spec = validate_spec(compose(), CATALOG)

    with pytest.raises(ParamError) as e:
        steps_of(spec, num_inference_steps=3, strength=0.2)
    assert e.value.field == "strength" and "leaves none" in e.value.message
    with pytest.raises(ParamError):
        steps_of(spec, num_inference_steps=3, strength=0.0)


def test_the_fraction_round_trips_and_specs_without_one_keep_their_encoding():
    spec = compose("start")
    loop = spec.body[2]
    assert isinstance(loop, LoopSpec)
    assert (loop.fraction, loop.rounding) == ("param:strength", "start")
    assert decode_spec(encode_spec(spec)) == spec
    plain = msgspec.structs.replace(loop, fraction="", rounding="count")
    assert b"fraction" not in msgspec.json.encode(plain) and b"rounding" not in msgspec.json.encode(plain)
    old = msgspec.json.decode(msgspec.json.encode(plain))
    assert msgspec.convert(old, LoopSpec).fraction == ""  # a stored spec from before decodes


def test_validation_names_a_bad_fraction_parameter_and_a_rounding_without_one():
    spec = validate_spec(compose(), CATALOG)
    loop = spec.body[2]
    assert isinstance(loop, LoopSpec)

    def problems(**changes: object) -> list[str]:
        params = {**spec.params, **changes.pop("params", {})}  # type: ignore[dict-item]
        body = [*spec.body[:2], msgspec.structs.replace(loop, **changes), spec.body[3]]
        with pytest.raises(SpecError) as e:
            validate_spec(msgspec.structs.replace(spec, body=body, params=params), CATALOG)
        return [str(p) for p in e.value.problems]

    assert problems(fraction="param:seed") == [
        "body[2].fraction: 'param:seed' must be param:NAME of a float parameter"
    ]
    assert problems(fraction="param:nope") == [
        "body[2].fraction: 'param:nope' must be param:NAME of a float parameter"
    ]
    unbounded = ParamSpec(type="float", default=0.6, minimum=0.0, maximum=2.0)
    assert problems(params={"strength": unbounded}) == [
        "params.strength: used as the fraction of loop 'denoise': needs `minimum` >= 0 and `maximum` <= 1"
    ]
    assert problems(fraction="", rounding="start") == [
        "body[2].rounding: applies only to a loop with a `fraction`"
    ]
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**msgspec.to_builtins(loop), "rounding": "nearest"}, LoopSpec)


def test_composition_refuses_a_fraction_that_is_no_parameter_and_an_unknown_rounding():
    with pytest.raises(CompositionError, match="rounding"):
        compose("nearest")
    with Workflow("w", params=PARAMS) as wf, pytest.raises(CompositionError, match="no parameter"):
        wf.loop(2, lambda step, latents: latents, fraction="strength", latents=wf.param("seed"))
