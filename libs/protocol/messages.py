"""Every message on the bus, as msgspec structs grouped into one tagged union per subject.

Conventions (docs/conventions.md, msgspec's schema-evolution rules): new fields always get defaults;
wire messages tolerate unknown fields so services of adjacent versions interoperate; tensor
*metadata* travels in messages, tensor and image *bytes* never do (NATS' 1 MiB payload limit).
Each subject's union is decoded by one ``Decoder`` built at import and dispatched with ``match``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from libs.protocol.ids import NodeRef
from libs.protocol.tensor_meta import TensorMeta

Scalar = int | float | str | bool | None
# A fraction in [0, 1], checked where a message is decoded (NaN and infinities never pass).
UnitFloat = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# A measured duration: finite, >= 0, and below ~11.6 days (no node runs that long; the bound also
# keeps a forged or broken value from charging a tenant absurd vTime). Checked where decoded.
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e6)]


class _Msg(msgspec.Struct, tag_field="type", omit_defaults=True):
    """Base of wire messages: tagged by ``type``; unknown fields are ignored."""


# -- intake: gateway -> scheduler (JetStream work queue) ---------------------------------------
class ImageRequest(_Msg, tag="image_request"):
    """One image to generate: one DAG instance. A call with ``n`` images sends ``n`` of these."""

    request_id: str
    tenant: str
    workflow: str
    version: int
    params: dict[str, Scalar]
    submitted_at: float  # unix seconds, set by the gateway
    timeout_s: float = 300.0


IntakeMsg = ImageRequest


# -- scheduler -> executor (request/reply on the executor's own subject) ----------------------
class TensorInput(msgspec.Struct, tag="tensor", tag_field="kind", omit_defaults=True):
    meta: TensorMeta


class TensorListInput(msgspec.Struct, tag="tensors", tag_field="kind", omit_defaults=True):
    """An input that is a list of tensors (e.g. a ControlNet's per-block residuals)."""

    metas: list[TensorMeta]


class ConstInput(msgspec.Struct, tag="const", tag_field="kind", omit_defaults=True):
    value: Scalar


class ImageInput(msgspec.Struct, tag="image", tag_field="kind", omit_defaults=True):
    """A picture sent with the request (an ``image`` parameter), in the images bucket."""

    name: str


class PendingInput(msgspec.Struct, tag="pending", tag_field="kind", omit_defaults=True):
    """A callback input whose producer is still running (§5.2): its metadata follows in a
    ``CallbackReady`` message, and the consumer fetches when its forward needs it."""

    producer: str  # node id within the request
    output: str


class LoraInput(msgspec.Struct, tag="lora", tag_field="kind", omit_defaults=True):
    """A ``lora`` parameter: a registered adapter's safetensors path, relative to the model root
    (executors refuse one that resolves outside it)."""

    path: str


InputBinding = TensorInput | TensorListInput | ConstInput | ImageInput | PendingInput | LoraInput


class OutputPlan(msgspec.Struct, omit_defaults=True):
    """What to do with one output: keep it for ``consumers`` readers, and/or upload it as a PNG."""

    name: str
    consumers: int = 0
    sink: str = ""  # object name in the images bucket ("" = not a workflow output)


class Dispatch(_Msg, tag="dispatch"):
    request_id: str
    attempt: int
    node_id: str
    tenant: str
    fn: str
    model: str
    inputs: dict[str, InputBinding]
    outputs: list[OutputPlan]
    callbacks: list[str] = []
    # The request's workflow: the unit an executor caches under the WCache deployment mode (its
    # models are keyed per workflow there, docs/scheduling.md "Deployment modes").
    workflow: str = ""
    # The fencing token of the scheduler that sent it (its lease's epoch): an executor refuses a
    # dispatch with a lower one than it has seen (``STALE_EPOCH``): that scheduler was replaced.
    epoch: int = 0
    # The sending scheduler's deployment mode (ours|nocache|wcache|mcache): how the scheduler
    # tells executors whose cache mode is not set which granularity to cache weights at.
    deployment: Annotated[str, msgspec.Meta(max_length=16)] = ""

    @property
    def ref(self) -> NodeRef:
        return NodeRef(self.request_id, self.attempt, self.node_id)


class ReleaseTensors(_Msg, tag="release_tensors"):
    """A consumer has read these tensors (one release per consuming edge). The one message an
    executor sends another: on the producer's ``{ns}.exec.{id}.release``, never on ``{ns}.exec.{id}``."""

    tensor_ids: list[str]


class ReleaseRequest(_Msg, tag="release_request"):
    """Free the tensors of one attempt of a request (or of every attempt: ``attempt = -1``).

    Sent when a request ends (a safety net: consumers release as they read), fails, or restarts.
    """

    request_id: str
    attempt: int = -1
    epoch: int = 0  # the sender's fencing token: ignored below the highest seen (as for Dispatch)


class LiveAttempts(_Msg, tag="live_attempts"):
    """The attempts the leading scheduler has in progress, broadcast every ``reconcile_s``.

    An executor frees what it holds of any attempt not listed that has had no node there for a
    grace period: the release of a request the scheduler ended (or forgot, by crashing) was lost.
    """

    attempts: list[str]  # encoded AttemptRefs (libs.protocol.ids): "request_id/attempt"
    epoch: int = 0  # the sender's fencing token: ignored below the highest seen (as for Dispatch)


class CallbackReady(_Msg, tag="callback_ready"):
    """The producer of a pending callback input has finished: here is where its output lives."""

    request_id: str
    attempt: int
    node_id: str  # the consuming node
    input: str
    meta: TensorMeta | list[TensorMeta]

    @property
    def ref(self) -> NodeRef:
        """The consuming node."""
        return NodeRef(self.request_id, self.attempt, self.node_id)


class CancelNode(_Msg, tag="cancel_node"):
    """Stop running this node (it overran its time limit, or its request ended): the executor
    answers ``NodeFailed(retryable=True, "cancelled by the scheduler")``; one not running the node
    ignores the message.

    A runner whose node sits in a thread (a real ``execute``) cannot stop it: with ``restart_ok``
    (a node over its time limit) the executor then exits after answering, for its supervisor to
    restart it; without (a request that ended) it lets the node finish rather than lose its loaded
    models to a restart.
    """

    request_id: str
    attempt: int
    node_id: str
    restart_ok: bool = False
    epoch: int = 0  # the sender's fencing token: ignored below the highest seen (as for Dispatch)

    @property
    def ref(self) -> NodeRef:
        return NodeRef(self.request_id, self.attempt, self.node_id)


#: ``Ack.error`` of a dispatch refused for its epoch: the scheduler that sent it must step down.
STALE_EPOCH = "stale scheduler epoch"


class Ack(_Msg, tag="ack"):
    ok: bool = True
    error: str = ""
    seq: int = 0  # the executor's heartbeat sequence number when it accepted the dispatch


# What the scheduler sends on ``{ns}.exec.{id}`` (and ``{ns}.exec.all``): executors may not publish
# there. Peers' ``ReleaseTensors`` have their own subject and decoder (``PeerMsg``).
ExecutorMsg = Dispatch | ReleaseRequest | CallbackReady | CancelNode | LiveAttempts
PeerMsg = ReleaseTensors


# -- executor -> scheduler (pub/sub events) ------------------------------------------------------
class NodeTiming(msgspec.Struct, frozen=True, omit_defaults=True):
    """Seconds measured on the executor (GPU time on a GPU box: CUDA events).

    Every field is validated when a completion is decoded (finite, >= 0): a completion that breaks
    that is dropped whole by the scheduler, and its node runs again (``docs/scheduling.md``).
    """

    load_s: Seconds = 0.0  # loading the model (0 when it was already resident)
    fetch_s: Seconds = 0.0  # pulling inputs through the data plane
    exec_s: Seconds = 0.0  # the ModelFn's execute()
    store_s: Seconds = 0.0  # writing outputs into the arena / uploading sinks
    # Where a load read its weights from: "" (no load), "host" (every checkpoint was in the box's
    # host tier) or "disk" (at least one was read from disk).
    load_tier: Literal["", "host", "disk"] = ""
    load_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0  # checkpoint bytes the load read from disk
    # The fraction of the model's bytes this run loaded onto the device: 1.0 for a load from nothing,
    # 0.0 when it was fully resident, in between when a prefix of its layers was resident (layer-
    # granular caching, paper §5.1). 0.0 with ``load_s > 0`` is an executor that predates the field:
    # the scheduler reads it as a whole load.
    load_frac: UnitFloat = 0.0

    @property
    def total_s(self) -> float:
        return self.load_s + self.fetch_s + self.exec_s + self.store_s


class ImageRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """A PNG in the JetStream object store."""

    bucket: str
    name: str
    nbytes: int
    width: int
    height: int


class NodeComplete(_Msg, tag="node_complete"):
    executor: str
    request_id: str
    attempt: int
    node_id: str
    outputs: dict[str, TensorMeta | list[TensorMeta]] = {}
    sinks: dict[str, ImageRef] = {}
    timing: NodeTiming = NodeTiming()
    bytes_in: Annotated[int, msgspec.Meta(ge=0)] = 0  # bytes pulled from other executors

    @property
    def ref(self) -> NodeRef:
        return NodeRef(self.request_id, self.attempt, self.node_id)


class NodeFailed(_Msg, tag="node_failed"):
    executor: str
    request_id: str
    attempt: int
    node_id: str
    error: str
    retryable: bool = False
    unreachable: str = ""  # a producer whose tensor could not be read (evidence it is gone)

    @property
    def ref(self) -> NodeRef:
        return NodeRef(self.request_id, self.attempt, self.node_id)


class ExecutorHeartbeat(_Msg, tag="heartbeat"):
    """Registration and liveness in one: the first heartbeat registers an executor."""

    executor: str
    kind: str  # "cpu" | "cuda" | "sim"
    transport: str
    address: str
    fns: list[str]  # ModelFn names this executor can run
    resident: list[str] = []  # encoded ModelKeys (libs.protocol.ids) whose model is loaded
    running: list[str] = []  # encoded NodeRefs (libs.protocol.ids) in progress
    # Encoded ModelKeys whose every checkpoint is in this box's host tier (a load would not touch
    # disk), and the tier's counters (hits, misses, bytes_filled, bytes_served, evictions, used_bytes,
    # budget_bytes, entries).
    host_resident: list[str] = []
    host_tier: dict[str, int] = {}
    # Encoded ModelKey -> [resident_layers, total_layers, resident_bytes, total_bytes] for every model
    # with at least one layer on the device (layer-granular caching: a prefix of its layers may be
    # resident). Fully loaded models are in ``resident`` too.
    cached: dict[str, list[int]] = {}
    arena_capacity: int = 0
    arena_free: int = 0
    started_at: float = 0.0
    seq: int = 0
    host: str = ""
    # The GPU this executor holds through the box's lease (libs/common/gpu_lease.py; "" none): an
    # operator sees from it that every executor of a box has a GPU of its own.
    gpu: Annotated[str, msgspec.Meta(max_length=64)] = ""


class ExecutorGoodbye(_Msg, tag="goodbye"):
    executor: str


SchedulerEvent = NodeComplete | NodeFailed | ExecutorHeartbeat | ExecutorGoodbye


# -- scheduler -> gateway ------------------------------------------------------------------------
class RequestResult(_Msg, tag="result"):
    request_id: str
    status: Literal["succeeded", "failed", "cancelled"]
    images: dict[str, ImageRef] = {}
    error: str = ""
    # "bad_params" | "workflow" | "timeout" | "internal" | "rate_limited" | "cancelled"
    error_code: str = ""
    nodes: int = 0  # nodes in the request's DAG
    executors: list[str] = []  # executors that ran nodes of this request
    bytes_moved: int = 0  # tensor bytes that crossed between executors
    # The vTime the tenant was charged for this image: the measured time of the nodes that ran
    # (a cancelled request's nodes still running when it ended are not charged; nor is lineage
    # re-execution after an executor was lost, which is the platform's loss).
    gpu_s: float = 0.0
    nodes_run: int = 0  # nodes of the answering attempt that completed


ResultMsg = RequestResult


# -- gateway -> scheduler: cancel (core NATS, backed by a Redis flag: docs/scheduling.md) --------
class CancelRequest(_Msg, tag="cancel_request"):
    """Stop an image request: a queued one is dropped, a running one dispatches nothing more and its
    running nodes are cancelled; it ends with a ``cancelled`` result. The gateway also flags the
    request in Redis (``cancel`` in ``{ns}:req:{id}``, and ``{ns}:cancels``), which is what makes the
    cancel survive a lost message or a scheduler fail-over; this message only makes it immediate."""

    request_id: str
    tenant: str
    reason: str = ""


# -- registry (request/reply) ---------------------------------------------------------------------
class RegisterWorkflow(_Msg, tag="register"):
    spec: msgspec.Raw  # raw JSON so the registry can name the bad field itself
    tenant: str = ""


class GetWorkflow(_Msg, tag="get"):
    name: str
    version: int = 0  # 0 = latest


class ListWorkflows(_Msg, tag="list"):
    pass


class LoraInfo(msgspec.Struct, omit_defaults=True):
    """A registered LoRA adapter: requests name it; executors load ``path`` (relative to their model
    root, never outside it) onto the base model."""

    name: str
    path: str
    description: str = ""


class RegisterLora(_Msg, tag="register_lora"):
    lora: LoraInfo


class GetLora(_Msg, tag="get_lora"):
    name: str


class ListLoras(_Msg, tag="list_loras"):
    pass


RegistryRequest = RegisterWorkflow | GetWorkflow | ListWorkflows | RegisterLora | GetLora | ListLoras


class Problem(msgspec.Struct):
    path: str
    message: str


class WorkflowSummary(msgspec.Struct):
    name: str
    version: int
    description: str = ""
    params: list[str] = []
    sizes: list[str] = []
    # What it can do: "generate", "edit", "inpaint" (libs/workflow/capabilities.py).
    capabilities: list[str] = []


class RegistryReply(_Msg, tag="registry_reply"):
    ok: bool
    spec: msgspec.Raw = msgspec.Raw()  # empty when there is no spec
    workflows: list[WorkflowSummary] = []
    error: str = ""
    status: int = 200  # HTTP status the gateway should answer with
    problems: list[Problem] = []
    created: bool = False
    loras: list[LoraInfo] = []


# Decoders, built once (msgspec's asyncio-kv example).
intake_decoder = msgspec.json.Decoder(IntakeMsg)
executor_decoder = msgspec.json.Decoder(ExecutorMsg)
peer_decoder = msgspec.json.Decoder(PeerMsg)
sched_decoder = msgspec.json.Decoder(SchedulerEvent)
result_decoder = msgspec.json.Decoder(ResultMsg)
cancel_decoder = msgspec.json.Decoder(CancelRequest)
registry_request_decoder = msgspec.json.Decoder(RegistryRequest)
registry_reply_decoder = msgspec.json.Decoder(RegistryReply)
ack_decoder = msgspec.json.Decoder(Ack)
encode = msgspec.json.Encoder().encode
