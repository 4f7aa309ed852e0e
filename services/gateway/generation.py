"""Checking an OpenAI-style image generation body against the workflow it names.

``POST /v1/images/generations`` takes OpenAI's fields (``model`` = workflow name, ``prompt``, ``n``,
``size``, ``response_format``, ``output_format``, ``output_compression``, ``background``) plus our
extensions (``seed``, ``num_inference_steps``, ``guidance_scale``, ``strength``, and ``params`` for any other
workflow parameter). ``size: "auto"`` is the workflow's default size; ``output_format`` is ``png``,
``jpeg`` or ``webp`` (transcoded at the gateway, ``formats.py``), with ``output_compression`` 0-100
for the lossy two. Every problem is reported with the field it concerns; nothing reaches the bus
before the body is fully valid (``image_requests`` builds what does: one message per image).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from libs.protocol.messages import ImageRequest, encode
from libs.workflow.errors import ParamError
from libs.workflow.params import resolve_params
from libs.workflow.spec import Scalar, WorkflowSpec, parse_size
from services.gateway.body import BUS_PAYLOAD_LIMIT, too_large
from services.gateway.errors import ApiError, invalid
from services.gateway.formats import DEFAULT_COMPRESSION, OUTPUT_FORMATS
from services.gateway.records import GenerationRecord

# Fields of OpenAI's API that do not apply to these workflows; accepted so OpenAI clients work.
IGNORED = {"user", "quality", "style", "moderation"}
# Top-level fields beyond OpenAI's that set the workflow parameter of the same name.
EXTENSIONS = ("seed", "num_inference_steps", "guidance_scale", "strength")
TOP_LEVEL_PARAMS = {"prompt", "width", "height", *EXTENSIONS}
OUTPUT = {"output_format", "output_compression", "background"}
BACKGROUNDS = (None, "auto", "opaque")  # the workflows paint every pixel: no transparent images
KNOWN = {"model", "prompt", "n", "size", "response_format", "params", *OUTPUT, *IGNORED, *EXTENSIONS}
RESPONSE_FORMATS = ("b64_json", "url")
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Generation:
    n: int
    response_format: str
    seeds: list[int | None]
    params: list[dict[str, Scalar]]  # one resolved parameter set per image
    output_format: str = "png"
    output_compression: int = DEFAULT_COMPRESSION
    size: str | None = None  # "WxH" as generated; None for a workflow of a fixed size


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_model(body: Any) -> str:
    """The workflow name, checked before anything else (it decides what else is valid)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is None:
        raise invalid("model", "is required (the name of a registered workflow)")
    if not isinstance(model, str) or not model:
        raise invalid("model", "must be a non-empty string")
    return model


def parse_generation(body: dict[str, Any], spec: WorkflowSpec, max_n: int) -> Generation:
    for key in body:
        if key not in KNOWN:
            raise invalid(key, "unknown field")
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "is required")
    if not isinstance(prompt, str) or not prompt.strip():
        raise invalid("prompt", "must be a non-empty string")
    n = body.get("n", 1)
    if not _is_int(n):
        raise invalid("n", f"must be an integer, got {type(n).__name__}")
    if not 1 <= n <= max_n:
        raise invalid("n", f"must be between 1 and {max_n}, got {n}")
    fmt = body.get("response_format", "b64_json")
    if fmt not in RESPONSE_FORMATS:
        raise invalid("response_format", f"must be one of {list(RESPONSE_FORMATS)}, got {fmt!r}")
    for key in IGNORED:
        if key in body and not isinstance(body[key], str | type(None)):
            raise invalid(key, "must be a string")
    out_fmt, compression = _output(body)

    params: dict[str, Any] = {"prompt": prompt}
    size = body.get("size")
    if size is not None and not isinstance(size, str):
        raise invalid("size", f"must be a string like '{(spec.sizes or ['256x256'])[0]}' or 'auto'")
    if size == "auto":  # OpenAI's "let the model choose": the workflow's default size
        size = None
    if spec.sizes:
        size = size or spec.sizes[0]
        if size not in spec.sizes:
            raise invalid(
                "size", f"{size!r} is not supported by workflow {spec.name!r}; supported: {spec.sizes}"
            )
        params["width"], params["height"] = parse_size(size)
    elif size is not None:
        raise invalid("size", f"workflow {spec.name!r} has a fixed size; leave `size` out or give 'auto'")

    for field in EXTENSIONS:
        if field in body:
            if field not in spec.params:
                raise invalid(field, f"workflow {spec.name!r} has no parameter {field!r}")
            params[field] = body[field]
    extra = body.get("params", {})
    if not isinstance(extra, dict):
        raise invalid("params", "must be an object of workflow parameters")
    for key, value in extra.items():
        if key in TOP_LEVEL_PARAMS:
            raise invalid(
                f"params.{key}", "is set by a top-level field (`size` for width/height); give it there"
            )
        params[key] = value

    seed_param = spec.params.get("seed")
    if seed_param is not None:
        seed = params.get("seed")
        if seed is None:
            seed = random.randrange(0, 2**31)  # reported back, so the image can be reproduced
        elif not _is_int(seed) or not 0 <= seed <= MAX_SEED - max_n:
            raise invalid("seed", f"must be an integer between 0 and {MAX_SEED - max_n}")
        seeds: list[int | None] = [seed + i for i in range(n)]
    else:
        seeds = [None] * n

    resolved = []
    for s in seeds:
        given = dict(params) if s is None else {**params, "seed": s}
        try:
            resolved.append(resolve_params(spec, given))
        except ParamError as e:
            field = _field_for(e.field, body)
            raise invalid(field, e.message) from None
    return Generation(
        n=n,
        response_format=fmt,
        seeds=seeds,
        params=resolved,
        output_format=out_fmt,
        output_compression=compression,
        size=size,
    )


def _output(body: dict[str, Any]) -> tuple[str, int]:
    """``output_format`` and ``output_compression``, checked (compression only for lossy formats)."""
    fmt = body.get("output_format")
    fmt = "png" if fmt is None else fmt
    if fmt not in OUTPUT_FORMATS:
        raise invalid("output_format", f"must be one of {list(OUTPUT_FORMATS)}, got {fmt!r}"[:300])
    if body.get("background") not in BACKGROUNDS:
        raise invalid("background", "only 'auto' and 'opaque' are supported (workflows make opaque images)")
    compression = body.get("output_compression")
    if compression is None:
        return fmt, DEFAULT_COMPRESSION
    if not _is_int(compression) or not 0 <= compression <= 100:
        raise invalid("output_compression", "must be an integer between 0 and 100")
    if fmt == "png":
        raise invalid(
            "output_compression", "applies to output_format 'jpeg' or 'webp' only (PNG is lossless)"
        )
    return fmt, compression


def _field_for(param: str, body: dict[str, Any]) -> str:
    """Name the field the client wrote: a top-level one, or ``params.X``."""
    if param in ("width", "height"):
        return "size"
    if param in EXTENSIONS or param == "prompt":
        return param
    return f"params.{param}" if param in body.get("params", {}) else param


def image_requests(rec: GenerationRecord, spec: WorkflowSpec, gen: Generation) -> list[ImageRequest]:
    """The bus messages of a checked call: one ``ImageRequest`` per image, each within the bus's
    payload limit (413 naming ``params`` otherwise)."""
    reqs = []
    now = time.time()
    for rid, params in zip(rec.request_ids, gen.params, strict=True):
        req = ImageRequest(
            request_id=rid,
            tenant=rec.tenant,
            workflow=spec.name,
            version=spec.version,
            params=params,
            submitted_at=now,
            timeout_s=rec.timeout_s,
        )
        if len(encode(req)) > BUS_PAYLOAD_LIMIT:
            raise too_large("the prompt and parameters of one image", BUS_PAYLOAD_LIMIT, param="params")
        reqs.append(req)
    return reqs
