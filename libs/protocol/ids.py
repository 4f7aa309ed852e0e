"""Every identifier the platform builds from parts, as a typed value with one encoder and one decoder.

Identifiers cross process boundaries as strings (in messages, Redis hashes, arena groups, object
names), but inside a service they are these values: placement compares ``ModelKey``s, the
scheduler core indexes nodes by ``NodeRef``, the executor groups arena blocks by ``AttemptRef``.
Building or parsing one of these strings anywhere else is a bug: a format change here must be the
only change.

| value | string form | used for |
|---|---|---|
| ``AttemptRef`` | ``{request_id}/{attempt}`` | one attempt at a request: the arena group its tensors belong to |
| ``NodeRef`` | ``{request_id}/{attempt}/{node_id}`` | one node of one attempt (dispatches, heartbeats' ``running``) |
| ``TensorRef`` | ``{request_id}/{attempt}/{node_id}/{output}`` | one output tensor (``TensorMeta.tensor_id``) |
| ``TensorRef`` of a list item | ``{request_id}/{attempt}/{node_id}/{output}#{index}`` | element ``index`` of a list-valued output |
| ``CallbackRef`` | ``{request_id}/{attempt}/{node_id}:{input}`` | one pending callback input of a running node |
| ``ModelKey`` | ``{fn}|{model}`` | a loaded model on an executor (heartbeats' ``resident``) |
| ``image_object`` | ``{request_id}/{name}.png`` | a workflow output in the images bucket |

Request ids are made by the gateway (hex) and may not contain ``/``; node ids (``transformer@3``)
and output names are identifiers from the validated spec. Decoders raise ``ValueError`` naming the
malformed string, so a bad value off the bus is refused where it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttemptRef", "CallbackRef", "ModelKey", "NodeRef", "TensorRef", "image_object"]


def _check_part(what: str, value: str, forbidden: str) -> None:
    if not value or any(c in value for c in forbidden):
        raise ValueError(f"{what} {value!r} must be non-empty and contain none of {forbidden!r}")


@dataclass(frozen=True, slots=True, order=True)
class AttemptRef:
    """One attempt at one request (a restart after a lost executor is the next attempt)."""

    request_id: str
    attempt: int

    def encode(self) -> str:
        return f"{self.request_id}/{self.attempt}"

    @classmethod
    def decode(cls, raw: str) -> AttemptRef:
        rid, sep, attempt = raw.partition("/")
        if not sep or not rid or not attempt.isdigit():
            raise ValueError(f"attempt reference {raw!r} is not 'request_id/attempt'")
        return cls(rid, int(attempt))

    def node(self, node_id: str) -> NodeRef:
        return NodeRef(self.request_id, self.attempt, node_id)

    def __str__(self) -> str:
        return self.encode()


@dataclass(frozen=True, slots=True, order=True)
class NodeRef:
    """One node of one attempt at a request."""

    request_id: str
    attempt: int
    node_id: str

    @property
    def attempt_ref(self) -> AttemptRef:
        return AttemptRef(self.request_id, self.attempt)

    def output(self, name: str) -> TensorRef:
        return TensorRef(self, name)

    def callback(self, input_name: str) -> CallbackRef:
        return CallbackRef(self, input_name)

    def encode(self) -> str:
        return f"{self.request_id}/{self.attempt}/{self.node_id}"

    @classmethod
    def decode(cls, raw: str) -> NodeRef:
        parts = raw.split("/", 2)
        if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2]:
            raise ValueError(f"node reference {raw!r} is not 'request_id/attempt/node_id'")
        return cls(parts[0], int(parts[1]), parts[2])

    def __str__(self) -> str:
        return self.encode()


@dataclass(frozen=True, slots=True, order=True)
class TensorRef:
    """One output tensor of one node: the ``tensor_id`` of its ``TensorMeta``.

    A list-valued output (a ControlNet's block samples) is stored one tensor per element; element
    ``i`` is ``item=i`` (``-1``: the output itself).
    """

    node: NodeRef
    output: str
    item: int = -1

    def at(self, index: int) -> TensorRef:
        """Element ``index`` of this list-valued output."""
        return TensorRef(self.node, self.output, index)

    def encode(self) -> str:
        base = f"{self.node.encode()}/{self.output}"
        return base if self.item < 0 else f"{base}#{self.item}"

    @classmethod
    def decode(cls, raw: str) -> TensorRef:
        head, sep, output = raw.rpartition("/")
        output, hash_, index = output.partition("#")
        if not sep or not output or (hash_ and not index.isdigit()):
            raise ValueError(f"tensor reference {raw!r} is not 'request_id/attempt/node_id/output[#index]'")
        try:
            return cls(NodeRef.decode(head), output, int(index) if hash_ else -1)
        except ValueError:
            raise ValueError(
                f"tensor reference {raw!r} is not 'request_id/attempt/node_id/output[#index]'"
            ) from None

    def __str__(self) -> str:
        return self.encode()


@dataclass(frozen=True, slots=True, order=True)
class CallbackRef:
    """A callback input (paper §5.2) of a dispatched node, waiting for its producer's metadata."""

    node: NodeRef
    input: str

    def encode(self) -> str:
        return f"{self.node.encode()}:{self.input}"

    @classmethod
    def decode(cls, raw: str) -> CallbackRef:
        head, sep, name = raw.rpartition(":")
        if not sep or not name:
            raise ValueError(f"callback reference {raw!r} is not 'request_id/attempt/node_id:input'")
        return cls(NodeRef.decode(head), name)

    def __str__(self) -> str:
        return self.encode()


@dataclass(frozen=True, slots=True, order=True)
class ModelKey:
    """A model as an executor holds it: the ModelFn that loaded it and the model name in the spec.

    Two ModelFns of one model folder (a text encoder and a VAE of one pipeline) load different
    weights, so residency is keyed by both.
    """

    fn: str
    model: str

    def encode(self) -> str:
        return f"{self.fn}|{self.model}"

    @classmethod
    def decode(cls, raw: str) -> ModelKey:
        fn, sep, model = raw.partition("|")
        if not sep or not fn or not model:
            raise ValueError(f"model key {raw!r} is not 'fn|model'")
        return cls(fn, model)

    def __str__(self) -> str:
        return self.encode()


def image_object(request_id: str, name: str) -> str:
    """The images-bucket object name of workflow output ``name`` of a request."""
    _check_part("request id", request_id, "/")
    return f"{request_id}/{name}.png"


# -- formats that are not a class of their own -----------------------------------------------------


def image_request_id(generation_id: str, index: int) -> str:
    """The request id of image ``index`` of a call (``{generation_id}-{index}``): one request each."""
    return f"{generation_id}-{index}"


def generation_of(request_id: str) -> str:
    """The call an image request belongs to (inverse of :func:`image_request_id`); a request id
    without an index is its own call."""
    return request_id.rpartition("-")[0] or request_id


def loop_suffix(outer: str, index: int) -> str:
    """The suffix of a node id unrolled at iteration ``index`` inside ``outer`` (``""`` at the top):
    ``x@3`` for step 3 of a top-level loop, ``x@3.1`` for iteration 1 of a loop inside it."""
    return f"{outer}.{index}" if outer else f"@{index}"


def split_node_id(node_id: str) -> tuple[str, tuple[str, ...]]:
    """``"x@3.1"`` -> ``("x", ("3", "1"))``: the op id and its loop indices, outermost first
    (``()`` for a node outside every loop)."""
    base, at, suffix = node_id.partition("@")
    return base, tuple(suffix.split(".")) if at else ()
