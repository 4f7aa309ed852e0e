"""The declarative, serialisable workflow spec: what the registry stores and versions.

A spec is data, never code. It names ModelFns by catalog name; their implementations are Python
classes installed on executors. The shape mirrors a composition (paper Fig. 7):

* ``params``: typed workflow parameters with defaults (prompt, seed, steps, guidance, ...).
* ``body``: calls of ModelFns (:class:`NodeSpec`) and loops (:class:`LoopSpec`), in program order.
* ``outputs``: the workflow's results (an image), by reference.

References are strings:

* ``param:NAME``  a workflow parameter (a scalar).
* ``var:NAME``    a loop variable of an enclosing loop: its index or a carried value.
* ``NODE.OUTPUT`` an output of a node, or ``LOOP.VAR`` the final value of a loop's carried variable.

A node input left out of ``inputs`` is bound by name (§4: "the I/O interfaces declared by setup_io
are sufficient to infer the DAG"): to the innermost loop variable of that name, else the most recent
preceding node output of that name, else the parameter of that name. Validation turns implicit
bindings into explicit references, so a stored spec is fully explicit.

A loop runs its body ``count`` times (a literal or an int parameter). ``carry`` gives each carried
variable its initial value; ``update`` gives its value for the next iteration, from the body. The
loop is unrolled per request, so every iteration's call is its own DAG node. With ``fraction`` (a
float parameter in [0, 1], img2img's ``strength``) it runs only the last iterations of ``count``, as
the img2img pipelines' ``get_timesteps`` skip the first steps of the schedule; the index then starts
at the first iteration run, so it stays a position in the whole schedule. ``rounding`` says which
number is rounded down: ``"count"`` the iterations run (``int(count * fraction)``, SD1.5),
``"start"`` those skipped (``int(count - count * fraction)``, Flux and SD3).
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

Scalar = int | float | str | bool | None

REF_PARAM = "param:"
REF_VAR = "var:"
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
NODE_ID = re.compile(rf"^{_NAME}$")
REF = re.compile(rf"^(param:{_NAME}|var:{_NAME}|{_NAME}\.{_NAME})$")
SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


class ParamSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A typed workflow parameter.

    Besides scalars: ``image`` is a picture sent with the request (base64 PNG over HTTP; a ControlNet's
    control image), reaching the ModelFn as a ``PIL.Image``; ``lora`` names a registered LoRA adapter
    (``""`` = none), reaching the ModelFn as the path of its safetensors file.
    """

    type: Literal["int", "float", "str", "bool", "image", "lora"]
    default: Scalar = None
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: list[Scalar] | None = None
    max_length: int | None = None
    description: str = ""


class NodeSpec(msgspec.Struct, tag="call", forbid_unknown_fields=True, omit_defaults=True):
    """One call of a ModelFn. ``inputs`` maps declared input names to references."""

    id: str
    fn: str
    model: str = ""
    inputs: dict[str, str] = {}
    consts: dict[str, Scalar] = {}
    callbacks: list[str] = []  # inputs fetched mid-execution; filled in from the ModelFn on validation


class LoopSpec(msgspec.Struct, tag="loop", forbid_unknown_fields=True, omit_defaults=True):
    """A loop combinator, unrolled per request (the denoising loop)."""

    id: str
    count: str | int
    body: list[NodeSpec | LoopSpec]
    index: str = "step"
    carry: dict[str, str] = {}
    update: dict[str, str] = {}
    fraction: str = ""  # param:NAME of a float in [0, 1]: run only the last iterations of count
    rounding: Literal["count", "start"] = "count"


Op = NodeSpec | LoopSpec


class WorkflowSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A registered workflow. ``version`` is assigned by the registry (0 = not yet stored)."""

    name: str
    body: list[Op]
    outputs: dict[str, str]
    params: dict[str, ParamSpec] = {}
    sizes: list[str] = []
    description: str = ""
    version: int = 0


def parse_size(size: str) -> tuple[int, int]:
    """``"256x128"`` -> ``(width, height)``; raises ``ValueError`` on anything else."""
    m = SIZE.match(size)
    if not m:
        raise ValueError(f"size {size!r} is not of the form WIDTHxHEIGHT")
    return int(m.group(1)), int(m.group(2))


def encode_spec(spec: WorkflowSpec) -> bytes:
    return msgspec.json.encode(spec)


def decode_spec(data: bytes | str) -> WorkflowSpec:
    """Decode and type-check a spec (raises ``msgspec.ValidationError`` naming the path)."""
    return msgspec.json.decode(data, type=WorkflowSpec)


def walk(body: list[Op], path: str = "body"):
    """Yield ``(path, op, enclosing_loops)`` for every op, depth first, in program order."""

    def rec(ops: list[Op], prefix: str, loops: tuple[LoopSpec, ...]):
        for i, op in enumerate(ops):
            p = f"{prefix}[{i}]"
            yield p, op, loops
            if isinstance(op, LoopSpec):
                yield from rec(op.body, f"{p}.body", (*loops, op))

    yield from rec(body, path, ())
