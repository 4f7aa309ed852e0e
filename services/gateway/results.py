"""Results of image requests as the gateway accepts and reports them.

A ``RequestResult`` comes off the bus (``{ns}.results.{id}``) or out of the request's state in
Redis. Either way it is checked against the request that asked for it before anything in it is
used: it must name that request, and every image it names must be that request's own object
(``image_object(request_id, output)``) in this namespace's bucket. Otherwise a result forged or
misrouted onto the results subject could make the gateway hand one tenant's picture to another.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import msgspec

from libs.protocol.ids import image_object
from libs.protocol.messages import RequestResult, result_decoder
from services.gateway.errors import ApiError

RATE_LIMITED_RETRY_AFTER_S = 2  # the scheduler's backlog of the tenant was full: retry a little later

Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
# What the scheduler writes into ``{ns}:req:{id}`` -> what a tenant is told.
STATUS: dict[str, Status] = {
    "submitted": "queued",
    "queued": "queued",
    "running": "running",
    "succeeded": "succeeded",
    "failed": "failed",
    "cancelled": "cancelled",
}
ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])(?:[A-Za-z]:)?[/\\](?:[^\s/\\'\"`,;:()]+[/\\])+[^\s/\\'\"`,;:()]*")


def result_problem(request_id: str, result: RequestResult, bucket: str) -> str | None:
    """Why ``result`` may not be used as the answer to ``request_id``; None when it may."""
    if result.request_id != request_id:
        return f"it names request {result.request_id!r}"
    for output, ref in result.images.items():
        try:
            own = image_object(request_id, output)
        except ValueError as e:
            return str(e)
        if ref.name != own:
            return f"its image {output!r} is object {ref.name!r}, not this request's {own!r}"
        if ref.bucket not in ("", bucket):
            return f"its image {output!r} is in bucket {ref.bucket!r}, not {bucket!r}"
    return None


def decode_checked(request_id: str, raw: bytes, bucket: str) -> tuple[RequestResult | None, str | None]:
    """A stored or received result, checked: (result, None) or (None, why it was refused)."""
    try:
        result = result_decoder.decode(raw)
    except msgspec.DecodeError as e:
        return None, f"malformed: {e}"
    problem = result_problem(request_id, result, bucket)
    return (None, problem) if problem else (result, None)


@dataclass(frozen=True)
class ImageState:
    status: Status
    result: RequestResult | None = None  # set once the request has ended


def call_status(states: list[ImageState]) -> Status:
    """One status for a call's images (the only place they are combined): a call with a cancelled
    image is ``cancelled`` once all its images have ended (``running`` until then: the others are
    being stopped); otherwise ``failed`` if any failed, ``succeeded`` when all did, ``running`` while
    any runs or is done, else ``queued``."""
    kinds = {s.status for s in states}
    if "cancelled" in kinds:
        return "cancelled" if all(s.result is not None for s in states) else "running"
    if "failed" in kinds:
        return "failed"
    if kinds == {"succeeded"}:
        return "succeeded"
    if kinds & {"running", "succeeded"}:
        return "running"
    return "queued"


def error_of(
    result: RequestResult | None, request_id: str, timeout_s: float, loras: dict[str, str]
) -> ApiError:
    """The error a call answers with for an image request that did not produce an image."""
    if result is None:
        return ApiError(504, f"request {request_id} did not finish within {timeout_s:.0f}s", code="timeout")
    code = result.error_code or "internal"
    message = redact(result.error, loras)
    if code == "bad_params":
        return ApiError(422, message, code=code)
    if code == "timeout":
        return ApiError(504, message, code=code)
    if code == "cancelled" or result.status == "cancelled":  # Call.cancel: by the cancel route or a hang-up
        why = f": {message}" if message else ""
        return ApiError(409, f"request {request_id} was cancelled{why}", code="cancelled")
    if code == "rate_limited":  # the tenant's backlog at the scheduler is full (max_tenant_backlog)
        return ApiError(429, message, code=code, retry_after=RATE_LIMITED_RETRY_AFTER_S)
    return ApiError(500, f"request {request_id} failed: {message or 'no image produced'}", code=code)


def redact(text: str, loras: dict[str, str]) -> str:
    """Error text from executors, with LoRA paths shown as their names and other paths hidden."""
    text = ABSOLUTE_PATH.sub("<path>", text)
    for path, name in sorted(loras.items(), key=lambda kv: -len(kv[0])):
        if path:
            text = text.replace(path, f"<lora {name}>")
    return text


def usage_of(results: list[RequestResult | None]) -> dict:
    """A call's ``usage``: OpenAI's token fields (always 0: workflows are not billed by tokens, but
    OpenAI clients parse them) plus the GPU-seconds each image was charged (what the platform bills
    and the tenants' quotas count; 0 for an image that has not ended)."""
    per_image = [round(float(getattr(r, "gpu_s", 0.0) or 0.0), 6) if r is not None else 0.0 for r in results]
    return {
        "input_tokens": 0,
        "output_tokens": 0,
        "total_tokens": 0,
        "input_tokens_details": {"text_tokens": 0, "image_tokens": 0},
        "gpu_seconds": round(sum(per_image), 6),
        "gpu_seconds_per_image": per_image,
    }
