"""The ModelFn: one model of a workflow, exposed as a serverless function (paper §4, Fig. 6).

A developer subclasses :class:`ModelFn` and implements three methods:

* ``setup_io()`` declares the inputs (``add_input(name, callback=False)``) and outputs
  (``add_output(name)``) by name. The platform infers the workflow DAG from these names.
* ``load_model(model_path, device, loader=None)`` loads the model's components once per executor
  onto ``device`` (a torch device string such as ``"cpu"`` or ``"cuda:0"``) and returns them as a
  dict; the executor keeps them and passes them to every ``execute`` call (code in ``execute`` that
  needs the device beyond its models' own reads it from there). ``loader`` is the executor's fast
  model loader (``libs.dataplane.loader.Loader``), passed only to implementations that accept the
  argument; built-in families load weights through it (``libs.models.common.load_component``) and
  list what they loaded under ``components["_loads"]``.
* ``execute(components, **inputs)`` runs one invocation and returns a dict with one entry per
  declared output. It must be deterministic given its inputs (seeds arrive as inputs), because the
  platform may retry a node and expects the same bytes.

Inputs are tensors (or lists of tensors) produced by other nodes, scalars (workflow parameters,
loop indices, constants), or images (``PIL.Image``, from ``image`` parameters such as a ControlNet's
control image). An output is a tensor or a list/tuple of tensors. An input declared with
``callback=True`` arrives as a :class:`Deferred`: the tensor is fetched only when ``execute`` calls
it (§5.2 callback-based fetching), so a base model can start its forward pass before a parallel
ControlNet has produced its output.

This module never imports torch: the registry reads the declared I/O of every ModelFn without it.
Implementations import torch inside ``load_model``/``execute`` (or in modules only executors load).
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgspec

from libs.workflow.errors import CompositionError

IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class Signature(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The declared I/O of a ModelFn: what the registry validates specs against."""

    inputs: dict[str, bool]  # input name -> callback?
    outputs: list[str]
    optional: list[str] = []  # inputs a workflow may leave unbound (execute gets its default)


class Deferred:
    """A callback input: calling it fetches the tensor (once) and returns it.

    The executor builds it around a fetch function; ``execute`` calls it at the program point
    that consumes the tensor, so the transfer overlaps with the computation before that point.
    """

    __slots__ = ("_fetch", "_value", "_done", "name")

    def __init__(self, name: str, fetch: Callable[[], Any]) -> None:
        self.name = name
        self._fetch = fetch
        self._value: Any = None
        self._done = False

    def __call__(self) -> Any:
        if not self._done:
            self._value = self._fetch()
            self._done = True
        return self._value

    @property
    def fetched(self) -> bool:
        return self._done


@dataclass
class _IO:
    inputs: dict[str, bool] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    optional: list[str] = field(default_factory=list)


class ModelFn:
    """Base class of every model function.

    Subclasses set ``fn_name`` (the catalog name workflows refer to, e.g. ``"flux.transformer"``)
    and implement the three methods. Instances are also the building blocks of a workflow
    composition: ``flux = FluxTransformer(model="tiny-flux")`` then ``flux(latents=...)`` inside a
    :class:`~libs.workflow.compose.Workflow` records a node (Fig. 7).
    """

    fn_name: ClassVar[str] = ""
    # The dtype this function's model runs at by default, per device type ({"cuda": "bfloat16"}):
    # the executor loads the weights at it unless T2I_EXECUTOR_DTYPES names one; the loader given
    # to ``load_model`` carries it as ``loader.dtype``. Empty (the default): as ``from_pretrained``
    # loads without ``torch_dtype``. The built-in families take theirs from libs.models.families.
    device_dtypes: ClassVar[dict[str, str]] = {}

    def __init__(self, model: str = "", *, id: str | None = None, **consts: Any) -> None:
        self.model = model
        self.id = id
        self.consts = consts
        self._io = _IO()
        self.setup_io()
        if not self._io.outputs:
            raise CompositionError(f"{type(self).__name__}.setup_io() declared no outputs")

    # -- developer API -------------------------------------------------------------------------
    def setup_io(self) -> None:
        """Declare inputs and outputs with :meth:`add_input` and :meth:`add_output`."""
        raise NotImplementedError(f"{type(self).__name__} must implement setup_io()")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        """Load this function's model components from ``model_path`` onto ``device`` (a torch device
        string, e.g. ``"cpu"`` or ``"cuda:0"``); called once per executor. The components are passed
        to every ``execute`` call; keep the device among them if ``execute`` needs it.

        ``loader`` is the executor's :class:`libs.dataplane.loader.Loader` (None: the process's
        default), which loads converted checkpoints from disk or the box's shared host tier. The
        executor passes it only if this method accepts a ``loader`` parameter, so an override with
        the older ``(model_path, device)`` signature keeps working. Implementations that load with
        ``libs.models.common.load_component`` record the loads under ``components["_loads"]``
        (``libs.models.common.with_loads``): a list of ``LoadedCheckpoint`` with ``source``
        (``"disk"`` or ``"host"``), ``bytes_from_disk`` and ``seconds``."""
        return {}

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        """Run one invocation; return one value per declared output."""
        raise NotImplementedError(f"{type(self).__name__} must implement execute()")

    def add_input(self, name: str, callback: bool = False, optional: bool = False) -> None:
        """Declare an input. ``callback=True``: fetched only when ``execute`` calls it (§5.2).
        ``optional=True``: a workflow may leave it unbound (bound by name when a value of that
        name is in scope), and ``execute`` then uses its own default — e.g. ``lora`` or
        ``control_outputs`` on a base model that also runs without adapters."""
        if not IDENT.match(name):
            raise CompositionError(f"input name {name!r} is not an identifier")
        if name in self._io.inputs:
            raise CompositionError(f"input {name!r} declared twice")
        self._io.inputs[name] = bool(callback)
        if optional:
            self._io.optional.append(name)

    def add_output(self, name: str) -> None:
        if not IDENT.match(name):
            raise CompositionError(f"output name {name!r} is not an identifier")
        if name in self._io.outputs:
            raise CompositionError(f"output {name!r} declared twice")
        self._io.outputs.append(name)

    # -- platform API --------------------------------------------------------------------------
    @classmethod
    def signature(cls) -> Signature:
        """The declared I/O, read without loading any model."""
        inst = cls.__new__(cls)
        io = inst._io = _IO()  # noqa: SLF001 - the class's own state, on a bare instance it just made
        inst.setup_io()
        return Signature(inputs=dict(io.inputs), outputs=list(io.outputs), optional=list(io.optional))

    @property
    def inputs(self) -> dict[str, bool]:
        return dict(self._io.inputs)

    @property
    def outputs(self) -> list[str]:
        return list(self._io.outputs)

    @property
    def optional(self) -> list[str]:
        return list(self._io.optional)

    def __call__(self, **bindings: Any) -> Any:
        """Record one invocation in the workflow being composed (see ``compose.Workflow``)."""
        recorder = RECORDER.get()
        if recorder is None:
            raise CompositionError(
                "a ModelFn is called outside `with Workflow(...)`: nothing to record it in"
            )
        return recorder.call(self, bindings)


class Recorder(Protocol):
    """What a ModelFn call records into: the workflow being composed (``compose.Workflow``)."""

    def call(self, fn: ModelFn, bindings: dict[str, Any]) -> Any: ...


#: The workflow being composed in this context; ``compose.Workflow`` sets it inside ``with``.
RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("t2i_workflow", default=None)
