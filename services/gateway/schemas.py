"""The gateway's request and response bodies as msgspec Structs, for ``GET /openapi.json``.

The handlers check bodies by hand (``generation.py``: field by field, so each error names its
field) and build answers as dicts; these Structs describe the same shapes, and ``openapi.py``
turns them into JSON Schema (``msgspec.json.schema_components``). ``tests/unit/test_openapi.py``
keeps them honest where drift would matter most: every field ``generation.py`` accepts is here.
Fields that only some answers carry are ``UNSET`` (not required in the schema).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from libs.protocol.messages import WorkflowSummary
from libs.workflow.spec import WorkflowSpec
from services.gateway.models import Model, ModelList

Scalar = str | int | float | bool


class ImageGenerationRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/images/generations``: OpenAI's fields, then ours. ``model`` is a workflow name."""

    model: str
    prompt: str
    n: int = 1
    size: str | UnsetType = UNSET  # "WxH" of the workflow's sizes, or "auto" (its default)
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | UnsetType = UNSET  # 0-100, jpeg/webp only; default 100
    background: Literal["auto", "opaque"] | None = None  # no transparent backgrounds
    seed: int | UnsetType = UNSET
    num_inference_steps: int | UnsetType = UNSET
    guidance_scale: float | UnsetType = UNSET
    strength: float | UnsetType = UNSET  # workflows with an input image: the share of the schedule run
    params: dict[str, Any] = {}  # any other workflow parameter (control images as base64 PNG)
    webhook: str | UnsetType = UNSET  # http(s) URL POSTed the final status object
    user: str | None = None  # accepted for OpenAI clients; not used
    quality: str | None = None  # accepted for OpenAI clients; not used
    style: str | None = None  # accepted for OpenAI clients; not used
    moderation: str | None = None  # accepted for OpenAI clients; not used


class ImageEditForm(msgspec.Struct, kw_only=True):
    """``POST /v1/images/edits`` (multipart/form-data): OpenAI's fields, then ours. ``image``
    (PNG, JPEG or WebP; several as ``image[]``) fills the workflow's ``image`` parameter, ``mask``
    (a PNG whose transparent pixels mark what to repaint; the image's size) its ``mask``."""

    image: bytes  # a file part
    mask: bytes | UnsetType = UNSET  # a file part
    model: str
    prompt: str
    n: int = 1
    size: str | UnsetType = UNSET
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | UnsetType = UNSET
    background: Literal["auto", "opaque"] | None = None
    seed: int | UnsetType = UNSET
    strength: float | UnsetType = UNSET  # the share of the schedule that runs (img2img, inpaint)
    num_inference_steps: int | UnsetType = UNSET
    guidance_scale: float | UnsetType = UNSET
    params: str | UnsetType = UNSET  # other workflow parameters: a JSON object, or ``params[name]`` fields
    user: str | None = None  # accepted for OpenAI clients; not used
    quality: str | None = None  # accepted for OpenAI clients; not used


class ImageItem(msgspec.Struct, kw_only=True):
    b64_json: str | UnsetType = UNSET  # the image in ``output_format``
    url: str | UnsetType = UNSET  # GET it with the same API key; ``.png``/``.jpeg``/``.webp``
    seed: int | UnsetType = UNSET  # the seed this image was made with (reproducible)


class InputTokensDetails(msgspec.Struct):
    text_tokens: int = 0
    image_tokens: int = 0


class Usage(msgspec.Struct):
    """OpenAI's token counts (always 0: not billed by tokens) and the GPU-seconds charged."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    gpu_seconds: float
    gpu_seconds_per_image: list[float]


class ImagesResponse(msgspec.Struct, kw_only=True):
    id: str  # the call's id: GET /v1/requests/{id}
    created: int
    model: str
    data: list[ImageItem]
    output_format: Literal["png", "jpeg", "webp"]
    usage: Usage
    size: str | UnsetType = UNSET


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None
    status: int | UnsetType = UNSET  # in a status object: the HTTP status the call answered with
    problems: list[dict[str, str]] | UnsetType = UNSET  # an invalid workflow spec: every problem


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail


class Progress(msgspec.Struct):
    nodes_done: int
    nodes_total: int
    step: int
    steps: int


class RequestStatus(msgspec.Struct, kw_only=True):
    """A generation call: ``GET /v1/requests/{id}``, the 202 of an async call, webhooks, SSE ``done``."""

    id: str
    object: Literal["image.generation.request"]
    created: int
    model: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    n: int
    completed: int
    usage: Usage
    progress: Progress | UnsetType = UNSET
    data: list[ImageItem] | UnsetType = UNSET  # succeeded
    error: ErrorDetail | UnsetType = UNSET  # failed or cancelled


class RequestList(msgspec.Struct):
    data: list[RequestStatus]
    object: Literal["list"] = "list"


class NodeEventTiming(msgspec.Struct, kw_only=True):
    load_s: float
    fetch_s: float
    exec_s: float
    store_s: float
    load_tier: str


class NodeEvent(msgspec.Struct, kw_only=True):
    """``event: node`` of ``GET /v1/requests/{id}/events``: one node of one image finished."""

    type: Literal["node"]
    image: int
    request_id: str
    node_id: str
    fn: str
    model: str
    executor: str
    done: int
    total: int
    step: int
    steps: int
    gpu_s: float
    timing: NodeEventTiming
    t: float


class WorkflowList(msgspec.Struct):
    data: list[WorkflowSummary]
    object: Literal["list"] = "list"


class WorkflowAnswer(msgspec.Struct, kw_only=True):
    workflow: WorkflowSpec
    created: bool | UnsetType = UNSET  # a registration: a new version (201) or the same (200)


class DagNodeView(msgspec.Struct, kw_only=True):
    id: str  # as the scheduler's node events name it: "dit@3", "x@1.2"
    fn: str
    model: str
    deps: list[str]  # nodes whose outputs it waits for
    callbacks: list[str]  # nodes it may start beside, fetching their outputs part-way (callbacks)


class WorkflowDag(msgspec.Struct, kw_only=True):
    workflow: str
    version: int
    nodes: list[DagNodeView]


class LoraRegistration(msgspec.Struct, kw_only=True):
    name: str
    path: str  # a safetensors file under the executors' model root
    description: str = ""


class Lora(msgspec.Struct):
    name: str
    description: str
    object: Literal["lora"] = "lora"


class LoraAnswer(msgspec.Struct, kw_only=True):
    lora: Lora
    created: bool | UnsetType = UNSET


class LoraList(msgspec.Struct):
    data: list[Lora]
    object: Literal["list"] = "list"


class TenantView(msgspec.Struct, kw_only=True):
    """A tenant in the scheduler's operator view (more fields may appear as the scheduler adds them)."""

    tenant: str
    vtime_s: float | UnsetType = UNSET  # cumulative vTime (fair-share clock)
    service_s: float | UnsetType = UNSET  # measured GPU-seconds served
    ops: int | UnsetType = UNSET
    queued: int | UnsetType = UNSET
    running: int | UnsetType = UNSET


class TenantList(msgspec.Struct):
    data: list[TenantView]
    object: Literal["list"] = "list"


class LimitsOverride(msgspec.Struct, kw_only=True):
    queued: int | None | UnsetType = UNSET  # 0: unlimited; null: the gateway's default
    gpu_s: float | None | UnsetType = UNSET


class QueuedLimit(msgspec.Struct):
    limit: int
    used: int


class GpuLimit(msgspec.Struct):
    limit: float
    used: float
    window_s: float
    window_ends_in_s: float


class TenantLimits(msgspec.Struct):
    tenant: str
    queued: QueuedLimit
    gpu_s: GpuLimit
    overrides: LimitsOverride


class ExecutorView(msgspec.Struct, kw_only=True):
    id: str
    kind: str | UnsetType = UNSET
    fns: list[str] | UnsetType = UNSET
    resident: list[str] | UnsetType = UNSET
    host_resident: list[str] | UnsetType = UNSET
    running: int | UnsetType = UNSET
    busy: float | UnsetType = UNSET
    seen: float | UnsetType = UNSET


class ExecutorList(msgspec.Struct):
    data: list[ExecutorView]
    object: Literal["list"] = "list"


class Health(msgspec.Struct):
    status: str


__all__ = [
    "ErrorResponse",
    "ExecutorList",
    "Health",
    "ImageGenerationRequest",
    "ImagesResponse",
    "LimitsOverride",
    "LoraAnswer",
    "LoraList",
    "LoraRegistration",
    "Model",
    "ModelList",
    "NodeEvent",
    "RequestList",
    "RequestStatus",
    "Scalar",
    "TenantLimits",
    "TenantList",
    "WorkflowAnswer",
    "WorkflowList",
]
