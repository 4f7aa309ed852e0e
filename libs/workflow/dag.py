"""Unrolling a validated spec into one request's DAG (paper §4, "Life of a Request").

Loops are unrolled by their count (the request's step count), so every iteration's call is its
own node: ``transformer@0``, ``transformer@1``, ... (nested loops: ``x@1.0``). A loop with a
``fraction`` (img2img's strength) runs only its last iterations, keeping their indices:
``transformer@2``, ``transformer@3`` for 4 steps at strength 0.5. Parameters and loop
indices become constants; references to outputs become tensor edges. The result is plain data that
the scheduler's state machine tracks; it does no I/O and needs no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libs.protocol.ids import loop_suffix
from libs.workflow.errors import ParamError
from libs.workflow.spec import REF_PARAM, REF_VAR, LoopSpec, NodeSpec, Op, Scalar, WorkflowSpec

MAX_NODES = 4096


@dataclass(frozen=True, slots=True)
class TensorSource:
    """An edge: the tensor ``output`` of DAG node ``node``."""

    node: str
    output: str


@dataclass(frozen=True, slots=True)
class Const:
    value: Scalar


@dataclass(frozen=True, slots=True)
class ImageSource:
    """An ``image`` parameter: ``ref`` names the picture (an object in the images bucket)."""

    ref: str


@dataclass(frozen=True, slots=True)
class LoraSource:
    """A ``lora`` parameter: the adapter's safetensors path (resolved on the executor)."""

    path: str


Source = TensorSource | Const | ImageSource | LoraSource


@dataclass(slots=True)
class DagNode:
    id: str
    fn: str
    model: str
    inputs: dict[str, Source]
    callbacks: frozenset[str]
    outputs: tuple[str, ...]
    deps: frozenset[str]  # nodes that must finish before this one starts (its ordinary inputs)
    order: int  # position in a topological order of the whole DAG
    # Producers of callback inputs only (§5.2): this node may start once they have *started*,
    # and fetches their outputs part-way through its own execution.
    cb_deps: frozenset[str] = frozenset()


@dataclass
class Dag:
    nodes: dict[str, DagNode]  # in topological order
    outputs: dict[str, TensorSource]  # workflow output name -> the tensor holding it
    consumers: dict[TensorSource, int] = field(default_factory=dict)  # readers per tensor (edges)
    successors: dict[str, list[str]] = field(default_factory=dict)  # via ordinary inputs
    cb_successors: dict[str, list[str]] = field(default_factory=dict)  # via callback inputs only


def unroll(
    spec: WorkflowSpec,
    params: Mapping[str, Scalar],
    callbacks: Mapping[str, frozenset[str]] | None = None,
    outputs_of: Mapping[str, tuple[str, ...]] | None = None,
) -> Dag:
    """Build the DAG of one request. ``spec`` must be validated; ``params`` resolved.

    ``callbacks`` maps a ModelFn name to its callback inputs and ``outputs_of`` to its declared
    outputs (from the catalog signatures); without ``outputs_of`` a node's outputs are those that
    something reads.
    """
    callbacks = callbacks or {}
    nodes: list[DagNode] = []
    read: dict[str, set[str]] = {}
    images = {n for n, p in spec.params.items() if p.type == "image"}
    loras = {n for n, p in spec.params.items() if p.type == "lora"}

    def param(name: str) -> Source:
        value = params[name]
        if name in images:
            return ImageSource(str(value)) if value else Const(None)
        if name in loras:
            return LoraSource(str(value)) if value else Const("")
        return Const(value)

    def run(
        ops: list[Op], env: dict[str, Source], suffix: str, outer: dict[str, object]
    ) -> dict[str, object]:
        # names: op id -> unrolled node id (nodes) or {var: Source} (loops), visible in this body.
        names: dict[str, object] = dict(outer)
        for op in ops:
            if isinstance(op, NodeSpec):
                node_id = op.id + suffix
                inputs: dict[str, Source] = {}
                for name, ref in op.inputs.items():
                    inputs[name] = resolve(ref, env, names)
                for name, c in op.consts.items():
                    inputs[name] = Const(c)
                for src in inputs.values():
                    if isinstance(src, TensorSource):
                        read.setdefault(src.node, set()).add(src.output)
                cbs = (frozenset(callbacks.get(op.fn, frozenset())) | frozenset(op.callbacks)) & frozenset(
                    inputs
                )
                deps = frozenset(
                    s.node for n, s in inputs.items() if isinstance(s, TensorSource) and n not in cbs
                )
                cb_deps = (
                    frozenset(s.node for n, s in inputs.items() if isinstance(s, TensorSource) and n in cbs)
                    - deps
                )
                outs = tuple(outputs_of[op.fn]) if outputs_of and op.fn in outputs_of else ()
                nodes.append(
                    DagNode(
                        id=node_id,
                        fn=op.fn,
                        model=op.model,
                        inputs=inputs,
                        callbacks=cbs,
                        outputs=outs,
                        deps=deps,
                        order=len(nodes),
                        cb_deps=cb_deps,
                    )
                )
                if len(nodes) > MAX_NODES:
                    raise ParamError(
                        "num_inference_steps", f"the request unrolls to more than {MAX_NODES} nodes"
                    )
                names[op.id] = node_id
            else:
                names[op.id] = run_loop(op, env, suffix, names)
        return names

    def resolve(ref: str, env: dict[str, Source], names: dict[str, object]) -> Source:
        if ref.startswith(REF_PARAM):
            return param(ref[len(REF_PARAM) :])
        if ref.startswith(REF_VAR):
            return env[ref[len(REF_VAR) :]]
        op_id, out = ref.split(".", 1)
        target = names[op_id]
        if isinstance(target, dict):  # a loop: its final carried value
            return target[out]
        return TensorSource(str(target), out)

    def run_loop(
        op: LoopSpec, env: dict[str, Source], suffix: str, names: dict[str, object]
    ) -> dict[str, Source]:
        if isinstance(op.count, int):
            count = op.count
        else:
            pname = op.count[len(REF_PARAM) :]
            count = params[pname]  # type: ignore[assignment]
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ParamError(pname, f"must be an integer of at least 1 (it counts loop {op.id!r})")
        start = 0
        if op.fraction:
            fname = op.fraction[len(REF_PARAM) :]
            fraction = params[fname]
            assert isinstance(fraction, int | float) and not isinstance(fraction, bool)
            start = tail_start(count, float(fraction), op.rounding)
            if start >= count:
                raise ParamError(
                    fname, f"{fraction} of loop {op.id!r}'s {count} iterations leaves none to run"
                )
        carried = {name: resolve(ref, env, names) for name, ref in op.carry.items()}
        for i in range(start, count):
            inner_env = {**env, op.index: Const(i), **carried}
            inner_suffix = loop_suffix(suffix, i)
            inner_names = run(op.body, inner_env, inner_suffix, names)
            carried = {name: resolve(ref, inner_env, inner_names) for name, ref in op.update.items()}
        return carried

    top = run(spec.body, {}, "", {})
    outputs: dict[str, TensorSource] = {}
    for name, ref in spec.outputs.items():
        src = resolve(ref, {}, top)
        assert isinstance(src, TensorSource), "validated specs only output tensors"
        outputs[name] = src
        read.setdefault(src.node, set()).add(src.output)

    consumers: dict[TensorSource, int] = {}
    successors: dict[str, list[str]] = {n.id: [] for n in nodes}
    cb_successors: dict[str, list[str]] = {n.id: [] for n in nodes}
    for n in nodes:
        for src in n.inputs.values():
            if isinstance(src, TensorSource):
                consumers[src] = consumers.get(src, 0) + 1
        for d in n.deps:
            successors[d].append(n.id)
        for d in n.cb_deps:
            cb_successors[d].append(n.id)
    if not outputs_of:
        for n in nodes:
            n.outputs = tuple(sorted(read.get(n.id, ())))
    return Dag(
        nodes={n.id: n for n in nodes},
        outputs=outputs,
        consumers=consumers,
        successors=successors,
        cb_successors=cb_successors,
    )


def tail_start(count: int, fraction: float, rounding: str) -> int:
    """The first iteration a loop of ``count`` iterations runs when only its last ``fraction`` runs,
    as the img2img pipelines' ``get_timesteps`` compute ``t_start``: ``"count"`` rounds down the
    number run (SD1.5: ``init_timestep = min(int(n * strength), n)``), ``"start"`` the number
    skipped (Flux, SD3: ``init_timestep = min(n * strength, n)``, ``t_start = int(n - init_timestep)``)."""
    if rounding == "count":
        return max(count - min(int(count * fraction), count), 0)
    return int(max(count - min(count * fraction, count), 0))


def workflow_dag(spec: WorkflowSpec, given: Mapping[str, object], max_nodes: int) -> Dag:
    """``spec`` unrolled for the parameters ``given`` (checked against their specs; defaults filled;
    a required one not given stood in for: only loop counts shape the DAG), refusing one that would
    have more than ``max_nodes`` nodes before building it (ParamError naming the loop's parameter).
    What a drawing of a request needs, without a request."""
    from libs.workflow.params import check_param

    params: dict[str, Scalar] = {}
    for name, value in given.items():
        p = spec.params.get(name)
        if p is None:
            known = ", ".join(sorted(spec.params)) or "none"
            raise ParamError(name, f"not a parameter of workflow {spec.name!r} (parameters: {known})")
        params[name] = check_param(name, p, value)
    for name, p in spec.params.items():
        if name not in params:
            params[name] = (
                p.default
                if p.default is not None
                else {"int": 1, "float": 0.0, "bool": False}.get(p.type, "")
            )
    for name, value in params.items():
        if spec.params[name].type == "int" and isinstance(value, int) and value > max_nodes:
            raise ParamError(name, f"{value} is more than a drawable DAG's {max_nodes} nodes")
    dag = unroll(spec, params)
    if len(dag.nodes) > max_nodes:
        raise ParamError(
            next(iter(spec.params), "params"), f"the DAG has {len(dag.nodes)} nodes, over {max_nodes}"
        )
    return dag
