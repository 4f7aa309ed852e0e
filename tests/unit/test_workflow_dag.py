"""Composition, validation and per-request unrolling of workflow specs (no torch, no broker)."""

from __future__ import annotations

import msgspec
import pytest

from libs.workflow.compose import Workflow
from libs.workflow.dag import Const, TensorSource, unroll
from libs.workflow.errors import CompositionError, ParamError, SpecError
from libs.workflow.params import resolve_params
from libs.workflow.spec import LoopSpec, NodeSpec, WorkflowSpec, decode_spec, encode_spec
from libs.workflow.validate import validate_spec
from tests.support.toyfns import (
    CATALOG,
    PARAMS,
    Control,
    ControlledDenoiser,
    Decode,
    Denoiser,
    Encode,
    Prepare,
    Step,
)


def compose_toy(name: str = "toy") -> WorkflowSpec:
    enc, prep, den, step, dec = Encode("m"), Prepare("m"), Denoiser("m"), Step("m"), Decode("m")
    with Workflow(name, params=PARAMS) as wf:
        enc()  # prompt bound by name to the parameter
        init = prep()

        def body(step: object, latents: object) -> object:
            noise_pred = den(latents=latents)  # prompt_embeds, timesteps, step by name
            return step_fn(noise_pred=noise_pred, latents=latents)

        step_fn = step
        latents = wf.loop("num_inference_steps", body, id="denoise", latents=init.latents)
        wf.output("image", dec(latents=latents))
    return wf.spec()


def test_composition_binds_undeclared_inputs_by_name_like_the_paper_figure_7():
    spec = compose_toy()
    enc, prep, loop, dec = spec.body
    assert isinstance(loop, LoopSpec)
    assert enc.inputs == {"prompt": "param:prompt"}
    assert prep.inputs == {"seed": "param:seed"}
    den, step = loop.body
    assert den.inputs == {
        "latents": "var:latents",
        "prompt_embeds": "encode.prompt_embeds",
        "timesteps": "prepare.timesteps",
        "step": "var:step",
    }
    assert step.inputs["noise_pred"] == "denoiser.noise_pred"
    assert loop.carry == {"latents": "prepare.latents"}
    assert loop.update == {"latents": "step.latents"}
    assert dec.inputs == {"latents": "denoise.latents"}
    assert spec.outputs == {"image": "decode.image"}


def test_spec_round_trips_through_json_and_validates():
    spec = compose_toy()
    again = decode_spec(encode_spec(spec))
    assert again == spec
    assert validate_spec(again, CATALOG) == spec


def test_unrolling_makes_one_denoiser_node_per_step_with_the_step_index_as_a_constant():
    spec = validate_spec(compose_toy(), CATALOG)
    params = resolve_params(spec, {"prompt": "a cat", "num_inference_steps": 4})
    dag = unroll(spec, params, outputs_of={k: tuple(v.outputs) for k, v in CATALOG.items()})
    ids = list(dag.nodes)
    assert ids == ["encode", "prepare"] + [f"{n}@{i}" for i in range(4) for n in ("denoiser", "step")] + [
        "decode"
    ]
    assert dag.nodes["denoiser@2"].inputs["step"] == Const(2)
    assert dag.nodes["denoiser@0"].inputs["latents"] == TensorSource("prepare", "latents")
    assert dag.nodes["denoiser@3"].inputs["latents"] == TensorSource("step@2", "latents")
    assert dag.nodes["decode"].inputs["latents"] == TensorSource("step@3", "latents")
    assert dag.nodes["encode"].inputs["prompt"] == Const("a cat")
    assert dag.outputs == {"image": TensorSource("decode", "image")}
    # prompt_embeds and timesteps are read by every step; the carried latents twice per step.
    assert dag.consumers[TensorSource("encode", "prompt_embeds")] == 4
    assert dag.consumers[TensorSource("prepare", "timesteps")] == 4
    assert dag.consumers[TensorSource("step@1", "latents")] == 2
    assert [n.id for n in dag.nodes.values() if not n.deps] == ["encode", "prepare"]
    assert sorted(dag.successors["prepare"]) == [
        "denoiser@0",
        "denoiser@1",
        "denoiser@2",
        "denoiser@3",
        "step@0",
    ]
    for node in dag.nodes.values():  # topological: every dependency comes earlier
        assert all(dag.nodes[d].order < node.order for d in node.deps)


def test_step_count_comes_from_the_request_and_defaults_from_the_spec():
    spec = validate_spec(compose_toy(), CATALOG)
    dag = unroll(spec, resolve_params(spec, {"prompt": "x"}))
    assert sum(1 for n in dag.nodes if n.startswith("denoiser@")) == 3  # the default


def test_parallel_controlnet_node_runs_beside_the_denoiser_and_callback_inputs_are_marked():
    enc, prep, ctl, den, step, dec = Encode(), Prepare(), Control(), ControlledDenoiser(), Step(), Decode()
    with Workflow("ctl", params=PARAMS) as wf:
        enc()
        init = prep()

        def body(step: object, latents: object) -> object:
            control_outputs = ctl(latents=latents)
            noise_pred = den(latents=latents, control_outputs=control_outputs)
            return step_(noise_pred=noise_pred, latents=latents)

        step_ = step
        wf.output("image", dec(latents=wf.loop(2, body, latents=init.latents)))
    spec = validate_spec(wf.spec(), CATALOG)
    (den_spec,) = [op for op in spec.body[2].body if op.fn == "toy.controlled_denoiser"]
    assert den_spec.callbacks == ["control_outputs"]  # the registry records it in the stored spec
    dag = unroll(spec, resolve_params(spec, {"prompt": "x"}))  # no signatures needed any more
    # The ControlNet and the denoiser of a step depend on the same things: they run in parallel.
    assert dag.nodes["control@0"].deps == dag.nodes["controlled_denoiser@0"].deps
    assert dag.nodes["controlled_denoiser@1"].callbacks == frozenset({"control_outputs"})
    # The denoiser need not wait for the ControlNet to finish, only to start (cb_deps).
    assert "control@1" not in dag.nodes["controlled_denoiser@1"].deps
    assert dag.nodes["controlled_denoiser@1"].cb_deps == frozenset({"control@1"})
    assert dag.cb_successors["control@1"] == ["controlled_denoiser@1"]
    assert dag.consumers[TensorSource("control@1", "control_outputs")] == 1


def hand_spec(**changes: object) -> WorkflowSpec:
    base = {
        "name": "hand",
        "params": {k: msgspec.to_builtins(v) for k, v in PARAMS.items()},
        "body": [
            {"type": "call", "id": "enc", "fn": "toy.encode"},
            {"type": "call", "id": "prep", "fn": "toy.prepare"},
            {
                "type": "loop",
                "id": "denoise",
                "count": "param:num_inference_steps",
                "carry": {"latents": "prep.latents"},
                "update": {"latents": "step.latents"},
                "body": [
                    {"type": "call", "id": "den", "fn": "toy.denoiser"},
                    {"type": "call", "id": "step", "fn": "toy.step"},
                ],
            },
            {"type": "call", "id": "dec", "fn": "toy.decode"},
        ],
        "outputs": {"image": "dec.image"},
    }
    base.update(changes)
    return msgspec.convert(base, WorkflowSpec)


def problems_of(spec: WorkflowSpec) -> list[str]:
    with pytest.raises(SpecError) as e:
        validate_spec(spec, CATALOG)
    return [str(p) for p in e.value.problems]


def test_hand_written_spec_without_inputs_is_bound_by_name_in_program_order():
    spec = validate_spec(hand_spec(), CATALOG)
    loop = spec.body[2]
    assert isinstance(loop, LoopSpec)
    den = loop.body[0]
    assert isinstance(den, NodeSpec)
    assert den.inputs["latents"] == "var:latents"  # the carried variable, not step.latents
    dec = spec.body[3]
    assert dec.inputs["latents"] == "denoise.latents"  # the loop's result, not prep.latents


def test_a_cycle_is_rejected_and_named():
    spec = hand_spec(
        body=[
            {
                "type": "call",
                "id": "a",
                "fn": "toy.step",
                "inputs": {"noise_pred": "b.noise_pred", "latents": "b.noise_pred"},
                "consts": {"step": 0},
            },
            {
                "type": "call",
                "id": "b",
                "fn": "toy.controlled_denoiser",
                "inputs": {
                    "latents": "a.latents",
                    "prompt_embeds": "a.latents",
                    "control_outputs": "a.latents",
                },
            },
            {"type": "call", "id": "dec", "fn": "toy.decode", "inputs": {"latents": "a.latents"}},
        ]
    )
    (msg,) = problems_of(spec)
    assert "cycle: a -> b -> a" in msg and msg.startswith("body[0]")


def test_forward_references_are_allowed_when_acyclic_and_get_sorted():
    spec = hand_spec(
        body=[
            {"type": "call", "id": "dec", "fn": "toy.decode", "inputs": {"latents": "prep.latents"}},
            {"type": "call", "id": "prep", "fn": "toy.prepare"},
        ]
    )
    assert [op.id for op in validate_spec(spec, CATALOG).body] == ["prep", "dec"]


def test_an_input_nobody_produces_is_rejected_naming_the_field():
    spec = hand_spec(body=[{"type": "call", "id": "dec", "fn": "toy.decode"}])
    assert problems_of(spec) == [
        "body[0].inputs.latents: input 'latents' of toy.decode is bound to nothing: no value named 'latents' precedes it"
    ]


def test_an_unknown_modelfn_is_rejected():
    spec = hand_spec(body=[{"type": "call", "id": "x", "fn": "toy.nope"}], outputs={"image": "x.image"})
    msgs = problems_of(spec)
    assert msgs[0].startswith("body[0].fn: unknown ModelFn 'toy.nope'")


def test_references_to_missing_nodes_outputs_params_and_loop_internals_are_rejected():
    spec = hand_spec(
        body=[
            {"type": "call", "id": "enc", "fn": "toy.encode", "inputs": {"prompt": "param:nope"}},
            {"type": "call", "id": "prep", "fn": "toy.prepare", "inputs": {"seed": "enc.missing"}},
            {
                "type": "loop",
                "id": "lp",
                "count": 2,
                "carry": {"latents": "prep.latents"},
                "update": {"latents": "st.latents"},
                "body": [
                    {"type": "call", "id": "st", "fn": "toy.step", "inputs": {"noise_pred": "var:latents"}}
                ],
            },
            {"type": "call", "id": "dec", "fn": "toy.decode", "inputs": {"latents": "st.latents"}},
        ]
    )
    msgs = problems_of(spec)
    assert "body[0].inputs.prompt: 'param:nope': no such parameter" in msgs
    assert any(
        m.startswith("body[1].inputs.seed: 'enc.missing': 'enc' has no output 'missing'") for m in msgs
    )
    assert (
        "body[3].inputs.latents: 'st.latents': 'st' is inside a loop; use that loop's carried values" in msgs
    )


def test_bad_parameter_types_and_bounds_are_rejected():
    params = {k: msgspec.to_builtins(v) for k, v in PARAMS.items()}
    params["num_inference_steps"] = {"type": "int", "default": "four", "minimum": 1}
    params["guidance_scale"] = {"type": "float", "default": 3.0, "minimum": 5.0, "maximum": 1.0}
    params["flag"] = {"type": "bool"}
    msgs = problems_of(hand_spec(params=params))
    assert "params.num_inference_steps.default: 'four' is not of type int" in msgs
    assert "params.guidance_scale: minimum 5.0 exceeds maximum 1.0" in msgs
    assert "params.flag: needs a default or `required: true`" in msgs


def test_a_spec_with_an_unknown_field_or_type_fails_to_decode_naming_the_path():
    with pytest.raises(msgspec.ValidationError, match=r"\$\.body\[0\]"):
        decode_spec(b'{"name":"x","outputs":{},"body":[{"type":"call","id":"a","fn":"t","bogus":1}]}')
    with pytest.raises(msgspec.ValidationError, match=r"params"):
        decode_spec(b'{"name":"x","outputs":{},"body":[],"params":{"p":{"type":"complex"}}}')


def test_loop_count_must_be_a_bounded_int_parameter():
    spec = hand_spec()
    params = dict(spec.params)
    params["num_inference_steps"] = msgspec.structs.replace(params["num_inference_steps"], minimum=None)
    msgs = problems_of(msgspec.structs.replace(spec, params=params))
    assert msgs == ["params.num_inference_steps: used as the count of loop 'denoise': needs `minimum` >= 1"]


def test_request_params_are_checked_and_defaults_filled():
    spec = validate_spec(compose_toy(), CATALOG)
    assert resolve_params(spec, {"prompt": "p", "guidance_scale": 2}) == {
        "prompt": "p",
        "seed": 0,
        "num_inference_steps": 3,
        "guidance_scale": 2.0,
    }
    for given, field, fragment in [
        ({}, "prompt", "is required"),
        ({"prompt": 5}, "prompt", "must be a string"),
        ({"prompt": "p", "num_inference_steps": 0}, "num_inference_steps", "at least 1"),
        ({"prompt": "p", "num_inference_steps": 2.0}, "num_inference_steps", "must be an integer"),
        ({"prompt": "p", "seed": True}, "seed", "must be an integer"),
        ({"prompt": "p", "bogus": 1}, "bogus", "not a parameter"),
        ({"prompt": "x" * 101}, "prompt", "at most 100 characters"),
    ]:
        with pytest.raises(ParamError) as e:
            resolve_params(spec, given)
        assert e.value.field == field and fragment in e.value.message


def test_composition_errors_are_caught_early():
    enc = Encode()
    with pytest.raises(CompositionError, match="outside"):
        enc()
    with Workflow("w", params=PARAMS) as wf:
        with pytest.raises(CompositionError, match="has no input 'bogus'"):
            enc(bogus=1)
        with pytest.raises(CompositionError, match="nothing named 'latents'"):
            Decode()()
        with pytest.raises(CompositionError, match="no output"):
            wf.spec()


def test_a_workflow_dag_for_drawing_fills_defaults_stands_in_for_required_params_and_is_bounded():
    from libs.sim.workflows import sim_workflow
    from libs.workflow.dag import unroll, workflow_dag
    from libs.workflow.errors import ParamError

    spec = sim_workflow("w", "m", steps=3)
    assert spec.params["prompt"].required  # not given: stood in for (it shapes nothing)
    dag = workflow_dag(spec, {"num_inference_steps": 4}, max_nodes=100)
    full = {n: p.default for n, p in spec.params.items()} | {"prompt": "x", "num_inference_steps": 4}
    assert list(dag.nodes) == list(unroll(spec, full).nodes)
    with pytest.raises(ParamError, match="nope"):
        workflow_dag(spec, {"nope": 1}, max_nodes=100)
    with pytest.raises(ParamError, match="num_inference_steps"):
        workflow_dag(spec, {"num_inference_steps": "four"}, max_nodes=100)
    with pytest.raises(ParamError, match="over 10"):
        workflow_dag(spec, {"num_inference_steps": 9}, max_nodes=10)
