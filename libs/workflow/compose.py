"""Composing a workflow from ModelFn instances (paper §4, Fig. 7), producing a declarative spec.

Composition *traces* the user's code: calling a ModelFn instance inside ``with Workflow(...)``
records a node and returns symbolic values, one per declared output. Inputs not passed explicitly
are bound by name to the most recent value of that name in scope (a loop variable, an earlier
output, a parameter), so the DAG follows from the declared I/O alone. The denoising loop is the
:meth:`Workflow.loop` combinator; it records the body once and the platform unrolls it per request
by its step count::

    with Workflow("tiny-flux", params=FLUX_PARAMS, sizes=["128x128"]) as wf:
        pooled = clip(prompt=wf.param("prompt"))
        t5_out = t5()                                    # prompt, max_sequence_length by name
        prep = prepare()
        def denoise(step, latents):
            noise_pred = flux(latents=latents)           # the rest by name
            return flow_step(noise_pred=noise_pred, latents=latents)
        latents = wf.loop("num_inference_steps", denoise, latents=prep.latents)
        wf.output("image", vae(latents=latents))
    spec = wf.spec()

No code is captured: the spec holds ModelFn names, model references and value references only.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from libs.workflow.errors import CompositionError
from libs.workflow.modelfn import IDENT, RECORDER, ModelFn
from libs.workflow.spec import REF_PARAM, REF_VAR, LoopSpec, NodeSpec, Op, ParamSpec, Scalar, WorkflowSpec


@dataclass(frozen=True)
class Value:
    """A symbolic value: a reference (``param:x``, ``var:x``, ``node.out``) and the name it goes by."""

    ref: str
    name: str
    workflow: int  # id() of the workflow, to catch values leaking between compositions


class Outputs:
    """The outputs of a call with several declared outputs: attribute, key and unpacking access."""

    def __init__(self, values: dict[str, Value]) -> None:
        self._values = values

    def __getattr__(self, name: str) -> Value:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no output named {name!r}; outputs are {list(self._values)}") from None

    def __getitem__(self, name: str) -> Value:
        return self._values[name]

    def __iter__(self) -> Iterator[Value]:
        return iter(self._values.values())


@dataclass
class _Frame:
    ops: list[Op] = field(default_factory=list)
    scope: dict[str, Value] = field(default_factory=dict)  # name -> most recent value
    vars: set[str] = field(default_factory=set)  # refs of this loop's variables


class Workflow:
    """A workflow under composition. Use as a context manager, then call :meth:`spec`."""

    def __init__(
        self,
        name: str,
        *,
        params: dict[str, ParamSpec] | None = None,
        sizes: list[str] | None = None,
        description: str = "",
    ) -> None:
        self.name = name
        self.params = dict(params or {})
        self.sizes = list(sizes or [])
        self.description = description
        self._frames: list[_Frame] = [_Frame()]
        self._outputs: dict[str, str] = {}
        self._ids: set[str] = set()
        self._token: contextvars.Token | None = None
        self._wid = id(self)
        for pname in self.params:
            self._frames[0].scope[pname] = Value(REF_PARAM + pname, pname, self._wid)

    # -- context ------------------------------------------------------------------------------
    def __enter__(self) -> Workflow:
        self._token = RECORDER.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        RECORDER.reset(self._token)
        self._token = None

    # -- building -----------------------------------------------------------------------------
    def param(self, name: str) -> Value:
        if name not in self.params:
            raise CompositionError(f"workflow {self.name!r} has no parameter {name!r}")
        return Value(REF_PARAM + name, name, self._wid)

    def call(self, fn: ModelFn, bindings: dict[str, Any]) -> Value | Outputs:
        if not fn.fn_name:
            raise CompositionError(f"{type(fn).__name__} has no fn_name: it cannot be registered")
        node_id = self._new_id(fn.id or fn.fn_name.rsplit(".", 1)[-1])
        inputs: dict[str, str] = {}
        consts: dict[str, Scalar] = {k: v for k, v in fn.consts.items()}
        for name, bound in bindings.items():
            if name not in fn.inputs:
                raise CompositionError(
                    f"{node_id}: {fn.fn_name} has no input {name!r}; inputs are {list(fn.inputs)}"
                )
            if isinstance(bound, Value):
                self._check_value(bound)
                inputs[name] = bound.ref
            elif bound is None or isinstance(bound, int | float | str | bool):
                consts[name] = bound
            else:
                raise CompositionError(
                    f"{node_id}.{name}: bind a workflow value or a scalar, not {type(bound).__name__}"
                )
        for name in fn.inputs:
            if name in inputs or name in consts:
                continue
            found = self._lookup(name)
            if found is None and name in fn.optional:
                continue
            if found is None:
                raise CompositionError(
                    f"{node_id}: input {name!r} of {fn.fn_name} is not bound and nothing named {name!r} is in scope"
                )
            inputs[name] = found.ref
        frame = self._frames[-1]
        frame.ops.append(NodeSpec(id=node_id, fn=fn.fn_name, model=fn.model, inputs=inputs, consts=consts))
        values = {out: Value(f"{node_id}.{out}", out, self._wid) for out in fn.outputs}
        frame.scope.update(values)
        return next(iter(values.values())) if len(values) == 1 else Outputs(values)

    def loop(
        self,
        count: str | int | Value,
        body: Callable[..., Value | Outputs | dict[str, Value]],
        *,
        index: str = "step",
        id: str = "loop",
        fraction: str | Value | None = None,
        rounding: str = "count",
        **carry: Value,
    ) -> Value | Outputs:
        """Run ``body`` ``count`` times (unrolled per request), threading the ``carry`` values.

        ``body`` is called once, with the loop index and each carried variable as symbolic
        values (keyword arguments); it returns the carried variables' next values (a value when
        one variable is carried, else a dict or Outputs). Returns the final carried values.
        With ``fraction`` (a float parameter, img2img's ``strength``) only the last iterations
        run, their indices unchanged; ``rounding`` is ``"count"`` or ``"start"``
        (:class:`~libs.workflow.spec.LoopSpec`).
        """
        if isinstance(count, Value):
            if not count.ref.startswith(REF_PARAM):
                raise CompositionError("a loop count must be an int or a workflow parameter")
            count_ref: str | int = count.ref
        elif isinstance(count, str):
            count_ref = self.param(count).ref
        elif isinstance(count, int) and not isinstance(count, bool):
            count_ref = count
        else:
            raise CompositionError(f"bad loop count {count!r}")
        fraction_ref = ""
        if isinstance(fraction, Value):
            if not fraction.ref.startswith(REF_PARAM):
                raise CompositionError("a loop fraction must be a workflow parameter")
            fraction_ref = fraction.ref
        elif isinstance(fraction, str):
            fraction_ref = self.param(fraction).ref
        elif fraction is not None:
            raise CompositionError(f"bad loop fraction {fraction!r}")
        if rounding not in ("count", "start"):
            raise CompositionError(f"loop rounding must be 'count' or 'start', not {rounding!r}")
        if not carry:
            raise CompositionError("a loop needs at least one carried variable")
        if not IDENT.match(index) or index in carry:
            raise CompositionError(f"bad loop index name {index!r}")
        loop_id = self._new_id(id)
        for v in carry.values():
            self._check_value(v)
        frame = _Frame()
        frame.scope[index] = Value(REF_VAR + index, index, self._wid)
        for name in carry:
            frame.scope[name] = Value(REF_VAR + name, name, self._wid)
        frame.vars = {v.ref for v in frame.scope.values()}
        self._frames.append(frame)
        try:
            result = body(**{index: frame.scope[index]}, **{n: frame.scope[n] for n in carry})
        finally:
            self._frames.pop()
        if isinstance(result, Value):
            if len(carry) != 1:
                raise CompositionError(
                    f"loop {loop_id!r} carries {list(carry)}: return a dict of their next values"
                )
            updates = {next(iter(carry)): result}
        elif isinstance(result, Outputs):
            updates = {n: result[n] for n in carry}
        elif isinstance(result, dict):
            updates = result
        else:
            raise CompositionError(f"loop {loop_id!r} body returned {type(result).__name__}, not values")
        if set(updates) != set(carry):
            raise CompositionError(
                f"loop {loop_id!r} body must return exactly {sorted(carry)}, got {sorted(updates)}"
            )
        for v in updates.values():
            self._check_value(v)
        spec = LoopSpec(
            id=loop_id,
            count=count_ref,
            index=index,
            body=frame.ops,
            carry={n: v.ref for n, v in carry.items()},
            update={n: v.ref for n, v in updates.items()},
            fraction=fraction_ref,
            rounding="start" if rounding == "start" else "count",
        )
        outer = self._frames[-1]
        outer.ops.append(spec)
        values = {n: Value(f"{loop_id}.{n}", n, self._wid) for n in carry}
        outer.scope.update(values)
        return next(iter(values.values())) if len(values) == 1 else Outputs(values)

    def output(self, name: str, value: Value) -> None:
        if len(self._frames) != 1:
            raise CompositionError("workflow outputs are declared outside loops")
        self._check_value(value)
        if not IDENT.match(name) or name in self._outputs:
            raise CompositionError(f"bad or duplicate output name {name!r}")
        self._outputs[name] = value.ref

    def spec(self) -> WorkflowSpec:
        if not self._outputs:
            raise CompositionError(f"workflow {self.name!r} declares no output (use wf.output(...))")
        return WorkflowSpec(
            name=self.name,
            description=self.description,
            params=dict(self.params),
            sizes=list(self.sizes),
            body=list(self._frames[0].ops),
            outputs=dict(self._outputs),
        )

    # -- helpers ------------------------------------------------------------------------------
    def _lookup(self, name: str) -> Value | None:
        for frame in reversed(self._frames):
            if name in frame.scope:
                return frame.scope[name]
        return None

    def _check_value(self, v: Value) -> None:
        if v.workflow != self._wid:
            raise CompositionError(f"value {v.ref!r} belongs to another workflow")
        if v.ref.startswith(REF_VAR) and not any(v.ref in f.vars for f in self._frames[1:]):
            raise CompositionError(f"loop variable {v.name!r} used outside its loop")

    def _new_id(self, base: str) -> str:
        base = base if IDENT.match(base) else "node"
        node_id, i = base, 2
        while node_id in self._ids:
            node_id, i = f"{base}_{i}", i + 1
        self._ids.add(node_id)
        return node_id
