"""Validating a workflow spec against the ModelFn catalog, and making its bindings explicit.

:func:`validate_spec` checks everything a registry must refuse to store, collecting *every*
problem with the path of the field it concerns:

* names and ids are well formed and node/loop ids unique;
* every ModelFn is known and is bound exactly its declared inputs (§4: the declared I/O defines
  the DAG); inputs left out are bound by name, to the most recent value of that name in scope;
* every reference resolves (a parameter, an enclosing loop's variable, an output of a node in the
  same or an enclosing body, or a loop's final carried value);
* parameters are typed, have a default or are required, and their bounds/choices are coherent;
* loops have a valid count (and fraction: a float parameter within [0, 1]), carried variables and
  an update for each;
* every body is acyclic (explicit references may point forward; cycles are reported as a path).

It returns the normalised spec: explicit references, ops of each body in a topological order.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from libs.workflow.errors import Problem, SpecError
from libs.workflow.modelfn import FN_NAME, IDENT, Signature
from libs.workflow.spec import (
    NODE_ID,
    REF,
    REF_PARAM,
    REF_VAR,
    LoopSpec,
    NodeSpec,
    Op,
    WorkflowSpec,
    parse_size,
)

WORKFLOW_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
MAX_OPS = 512  # ops in a spec before unrolling; unrolled DAGs are bounded by the step limit


@dataclass
class _Body:
    """One body (the workflow's or a loop's) while it is being resolved."""

    ops: list[Op]
    path: str
    loop: LoopSpec | None = None
    vars: set[str] = field(default_factory=set)
    outputs: dict[str, set[str]] = field(default_factory=dict)  # op id -> names it produces
    recent: dict[str, str] = field(default_factory=dict)  # name -> ref of the latest definition
    edges: dict[str, set[str]] = field(default_factory=dict)  # op id -> op ids it depends on
    index: dict[str, int] = field(default_factory=dict)  # op id -> position in program order


class _Validator:
    def __init__(self, spec: WorkflowSpec, catalog: Mapping[str, Signature]) -> None:
        self.spec = spec
        self.catalog = catalog
        self.problems: list[Problem] = []
        self.where: dict[str, tuple[_Body, ...]] = {}  # op id -> chain of bodies down to its own
        self.loop_bodies: dict[str, _Body] = {}  # loop id -> its body

    def problem(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    # -- entry --------------------------------------------------------------------------------
    def run(self) -> WorkflowSpec:
        spec = self.spec
        if not WORKFLOW_NAME.match(spec.name):
            self.problem("name", f"{spec.name!r} must match {WORKFLOW_NAME.pattern}")
        self.check_params()
        self.check_sizes()
        root = _Body(ops=list(spec.body), path="body")
        if not spec.body:
            self.problem("body", "a workflow needs at least one node")
        self.index_ids(root, ())
        if sum(1 for _ in self.where) > MAX_OPS:
            self.problem("body", f"more than {MAX_OPS} nodes")
        root.recent = {p: REF_PARAM + p for p in spec.params}
        body = self.resolve_body(root, (root,))
        outputs = self.check_outputs(root)
        if self.problems:
            raise SpecError(self.problems)
        return msgspec.structs.replace(spec, body=body, outputs=outputs)

    # -- parameters and sizes ---------------------------------------------------------------
    def check_params(self) -> None:
        for name, p in self.spec.params.items():
            path = f"params.{name}"
            if not IDENT.match(name):
                self.problem(path, "parameter names must be identifiers")
            values: list[tuple[str, object]] = [("default", p.default)] if p.default is not None else []
            values += [(f"choices[{i}]", c) for i, c in enumerate(p.choices or [])]
            for where, v in values:
                if not _has_type(v, p.type):
                    self.problem(f"{path}.{where}", f"{v!r} is not of type {p.type}")
            if p.default is None and not p.required and p.type != "image":
                self.problem(path, "needs a default or `required: true`")
            if p.type == "image" and p.default is not None:
                self.problem(
                    f"{path}.default", "an image parameter has no default (leave it out, or make it required)"
                )
            if p.default is not None and p.required:
                self.problem(path, "a required parameter has no default")
            if (p.minimum is not None or p.maximum is not None) and p.type not in ("int", "float"):
                self.problem(path, f"minimum/maximum apply to numbers, not {p.type}")
            if p.minimum is not None and p.maximum is not None and p.minimum > p.maximum:
                self.problem(path, f"minimum {p.minimum} exceeds maximum {p.maximum}")
            if p.max_length is not None and (p.type != "str" or p.max_length < 1):
                self.problem(f"{path}.max_length", "applies to str parameters and must be >= 1")
            if p.choices is not None and not p.choices:
                self.problem(f"{path}.choices", "must not be empty")
            d = p.default
            if d is not None and _has_type(d, p.type):
                if p.minimum is not None and isinstance(d, int | float) and d < p.minimum:
                    self.problem(f"{path}.default", f"{d} is below the minimum {p.minimum}")
                if p.maximum is not None and isinstance(d, int | float) and d > p.maximum:
                    self.problem(f"{path}.default", f"{d} is above the maximum {p.maximum}")
                if p.choices and d not in p.choices:
                    self.problem(f"{path}.default", f"{d!r} is not one of the choices")

    def check_sizes(self) -> None:
        for i, s in enumerate(self.spec.sizes):
            try:
                parse_size(s)
            except ValueError as e:
                self.problem(f"sizes[{i}]", str(e))
        if self.spec.sizes:
            for dim in ("height", "width"):
                p = self.spec.params.get(dim)
                if p is None or p.type != "int":
                    self.problem(f"params.{dim}", "a workflow with `sizes` needs an int parameter " + dim)

    # -- ids ------------------------------------------------------------------------------------
    def index_ids(self, body: _Body, chain: tuple[_Body, ...]) -> None:
        chain = (*chain, body)
        for i, op in enumerate(body.ops):
            path = f"{body.path}[{i}]"
            if not NODE_ID.match(op.id):
                self.problem(f"{path}.id", f"{op.id!r} is not an identifier")
            elif op.id in self.where:
                self.problem(f"{path}.id", f"duplicate id {op.id!r}")
                continue
            self.where[op.id] = chain
            body.index[op.id] = i
            if isinstance(op, NodeSpec):
                sig = self.catalog.get(op.fn)
                body.outputs[op.id] = set(sig.outputs) if sig else set()
            else:
                body.outputs[op.id] = set(op.carry)
                inner = _Body(ops=list(op.body), path=f"{path}.body", loop=op)
                self.loop_bodies[op.id] = inner
                self.index_ids(inner, chain)

    # -- references -----------------------------------------------------------------------------
    def resolve_ref(self, ref: str, path: str, chain: tuple[_Body, ...], user: str) -> str | None:
        """Check one explicit reference and record the dependency it creates. Returns it or None."""
        if not REF.match(ref):
            self.problem(path, f"{ref!r} is not a reference (param:NAME, var:NAME or NODE.OUTPUT)")
            return None
        if ref.startswith(REF_PARAM):
            if ref[len(REF_PARAM) :] not in self.spec.params:
                self.problem(path, f"{ref!r}: no such parameter")
                return None
            return ref
        if ref.startswith(REF_VAR):
            name = ref[len(REF_VAR) :]
            if not any(name in b.vars for b in chain):
                self.problem(path, f"{ref!r}: no enclosing loop has a variable {name!r}")
                return None
            return ref
        target, out = ref.split(".", 1)
        where = self.where.get(target)
        if where is None:
            self.problem(path, f"{ref!r}: no node or loop {target!r}")
            return None
        level = len(where) - 1
        if level >= len(chain) or chain[level] is not where[-1]:
            self.problem(path, f"{ref!r}: {target!r} is inside a loop; use that loop's carried values")
            return None
        body = chain[level]
        if out not in body.outputs.get(target, set()):
            have = sorted(body.outputs.get(target, set()))
            self.problem(path, f"{ref!r}: {target!r} has no output {out!r} (it has {have})")
            return None
        # The dependent op at the target's level is the ancestor of the user in that body.
        dependent = user if level == len(chain) - 1 else chain[level + 1].loop.id  # type: ignore[union-attr]
        body.edges.setdefault(dependent, set()).add(target)
        return ref

    def lookup(self, name: str, chain: tuple[_Body, ...]) -> str | None:
        for body in reversed(chain):
            if name in body.recent:
                return body.recent[name]
        return None

    # -- bodies -----------------------------------------------------------------------------------
    def resolve_body(self, body: _Body, chain: tuple[_Body, ...]) -> list[Op]:
        out: list[Op] = []
        for i, op in enumerate(body.ops):
            path = f"{body.path}[{i}]"
            if isinstance(op, NodeSpec):
                node = self.resolve_node(op, path, chain)
                out.append(node)
                for name in body.outputs.get(op.id, ()):
                    body.recent[name] = f"{op.id}.{name}"
            else:
                out.append(self.resolve_loop(op, path, chain))
                for name in op.carry:
                    body.recent[name] = f"{op.id}.{name}"
        return self.toposort(body, out)

    def resolve_node(self, op: NodeSpec, path: str, chain: tuple[_Body, ...]) -> NodeSpec:
        if not FN_NAME.match(op.fn):
            self.problem(f"{path}.fn", f"{op.fn!r} is not a ModelFn name")
            return op
        sig = self.catalog.get(op.fn)
        if sig is None:
            known = ", ".join(sorted(self.catalog)) or "none"
            self.problem(f"{path}.fn", f"unknown ModelFn {op.fn!r} (known: {known})")
            return op
        inputs: dict[str, str] = {}
        for name, ref in op.inputs.items():
            if name not in sig.inputs:
                self.problem(
                    f"{path}.inputs.{name}", f"{op.fn} has no input {name!r} (inputs: {list(sig.inputs)})"
                )
                continue
            if name in op.consts:
                self.problem(f"{path}.inputs.{name}", "bound both as a reference and as a constant")
                continue
            resolved = self.resolve_ref(ref, f"{path}.inputs.{name}", chain, op.id)
            if resolved:
                inputs[name] = resolved
        for name in op.consts:
            if name not in sig.inputs:
                self.problem(
                    f"{path}.consts.{name}", f"{op.fn} has no input {name!r} (inputs: {list(sig.inputs)})"
                )
        for name in sig.inputs:
            if name in op.inputs or name in op.consts:
                continue
            found = self.lookup(name, chain)
            if found is None and name in sig.optional:
                continue  # left unbound: execute() uses its default
            if found is None:
                self.problem(
                    f"{path}.inputs.{name}",
                    f"input {name!r} of {op.fn} is bound to nothing: no value named {name!r} precedes it",
                )
                continue
            resolved = self.resolve_ref(found, f"{path}.inputs.{name}", chain, op.id)
            if resolved:
                inputs[name] = resolved
        callbacks = sorted(n for n in inputs if sig.inputs.get(n))
        return msgspec.structs.replace(op, inputs=dict(sorted(inputs.items())), callbacks=callbacks)

    def resolve_loop(self, op: LoopSpec, path: str, chain: tuple[_Body, ...]) -> LoopSpec:
        body = self.loop_bodies.get(op.id) or _Body(ops=list(op.body), path=f"{path}.body", loop=op)
        if isinstance(op.count, str):
            pname = op.count[len(REF_PARAM) :] if op.count.startswith(REF_PARAM) else None
            p = self.spec.params.get(pname) if pname else None
            if p is None or p.type != "int":
                self.problem(
                    f"{path}.count", f"{op.count!r} must be an int literal or param:NAME of an int parameter"
                )
            elif p.minimum is None or p.minimum < 1:
                self.problem(f"params.{pname}", f"used as the count of loop {op.id!r}: needs `minimum` >= 1")
        elif isinstance(op.count, bool) or op.count < 1:
            self.problem(f"{path}.count", "must be at least 1")
        if op.fraction:
            self.check_fraction(op, path)
        elif op.rounding != "count":
            self.problem(f"{path}.rounding", "applies only to a loop with a `fraction`")
        names = [op.index, *op.carry]
        for name in names:
            if not IDENT.match(name):
                self.problem(f"{path}", f"loop variable {name!r} is not an identifier")
            if any(name in b.vars for b in chain):
                self.problem(f"{path}", f"loop variable {name!r} shadows a variable of an enclosing loop")
        if op.index in op.carry:
            self.problem(f"{path}.index", f"{op.index!r} is also a carried variable")
        if not op.carry:
            self.problem(f"{path}.carry", "a loop needs at least one carried variable")
        if set(op.update) != set(op.carry):
            self.problem(f"{path}.update", f"must give the next value of exactly {sorted(op.carry)}")
        if not op.body:
            self.problem(f"{path}.body", "a loop needs at least one node")
        carry = {}
        for name, ref in op.carry.items():
            r = self.resolve_ref(ref, f"{path}.carry.{name}", chain, op.id)
            if r:
                carry[name] = r
        body.vars = set(names)
        body.recent = {n: REF_VAR + n for n in names}
        inner_chain = (*chain, body)
        new_body = self.resolve_body(body, inner_chain)
        update = {}
        for name, ref in op.update.items():
            if ref.startswith(REF_PARAM):
                self.problem(
                    f"{path}.update.{name}", "a carried variable is updated from the body, not a parameter"
                )
                continue
            # Updates feed the *next* iteration: they are not dependencies inside the body.
            r = self.resolve_ref(ref, f"{path}.update.{name}", inner_chain, "__update__")
            if r:
                update[name] = r
        body.edges.pop("__update__", None)
        return msgspec.structs.replace(op, body=new_body, carry=carry, update=update)

    def check_fraction(self, op: LoopSpec, path: str) -> None:
        fname = op.fraction[len(REF_PARAM) :] if op.fraction.startswith(REF_PARAM) else None
        f = self.spec.params.get(fname) if fname else None
        if f is None or f.type != "float":
            self.problem(f"{path}.fraction", f"{op.fraction!r} must be param:NAME of a float parameter")
        elif f.minimum is None or f.minimum < 0 or f.maximum is None or f.maximum > 1:
            self.problem(
                f"params.{fname}",
                f"used as the fraction of loop {op.id!r}: needs `minimum` >= 0 and `maximum` <= 1",
            )

    def toposort(self, body: _Body, ops: list[Op]) -> list[Op]:
        """Order a body's ops so dependencies come first; program order breaks ties."""
        ids = [op.id for op in ops]
        pos = {i: n for n, i in enumerate(ids)}
        deps = {i: {d for d in body.edges.get(i, set()) if d in pos} for i in ids}
        users: dict[str, set[str]] = {i: set() for i in ids}
        for i, ds in deps.items():
            for d in ds:
                users[d].add(i)
        indeg = {i: len(ds) for i, ds in deps.items()}
        heap = [(pos[i], i) for i in ids if indeg[i] == 0]
        heapq.heapify(heap)
        order: list[str] = []
        while heap:
            _, i = heapq.heappop(heap)
            order.append(i)
            for u in users[i]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(heap, (pos[u], u))
        if len(order) < len(ids):
            cycle = _find_cycle({i: deps[i] for i in ids if i not in order})
            first = min(cycle, key=lambda i: pos[i])
            self.problem(f"{body.path}[{body.index.get(first, pos[first])}]", "cycle: " + " -> ".join(cycle))
            return ops
        by_id = {op.id: op for op in ops}
        return [by_id[i] for i in order]

    def check_outputs(self, root: _Body) -> dict[str, str]:
        if not self.spec.outputs:
            self.problem("outputs", "a workflow needs at least one output")
        out = {}
        for name, ref in self.spec.outputs.items():
            path = f"outputs.{name}"
            if not IDENT.match(name):
                self.problem(path, "output names must be identifiers")
            if ref.startswith((REF_PARAM, REF_VAR)):
                self.problem(path, f"{ref!r}: a workflow output must be produced by a node")
                continue
            r = self.resolve_ref(ref, path, (root,), "__output__")
            if r:
                out[name] = r
        root.edges.pop("__output__", None)
        return out


def _has_type(v: object, t: str) -> bool:
    if t == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "float":
        return isinstance(v, int | float) and not isinstance(v, bool)
    if t in ("str", "lora", "image"):
        return isinstance(v, str)
    return isinstance(v, bool)


def _find_cycle(deps: dict[str, set[str]]) -> list[str]:
    """A cycle in a graph where every node has an unresolved dependency: walk until a repeat."""
    start = min(deps)
    seen: dict[str, int] = {}
    path: list[str] = []
    node = start
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = min(d for d in deps[node] if d in deps)
    return [*path[seen[node] :], node]


def validate_spec(spec: WorkflowSpec, catalog: Mapping[str, Signature]) -> WorkflowSpec:
    """Validate ``spec``; return it normalised (explicit refs, topological order) or raise SpecError."""
    return _Validator(spec, catalog).run()
