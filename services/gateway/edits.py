"""Reading an OpenAI-style image edit: the multipart form of ``POST /v1/images/edits``.

OpenAI's form has ``image`` (one file, or several as ``image[]``), an optional ``mask`` (a PNG
whose fully transparent pixels mark the area to repaint), ``prompt``, ``model``, ``n``, ``size``,
``response_format``, ``output_format``, ``output_compression``, ``background``; we add ``seed``,
``strength``, ``num_inference_steps``, ``guidance_scale`` and any other workflow parameter as
``params[name]`` (or ``params`` as a JSON object).

The form becomes the same body a generation has (``generation.parse_generation`` checks it), with
each file in the workflow parameter of its name: the first image in ``image``, further ones in
``image_2``, ``image_3``, …, the mask in ``mask``. A workflow can edit when it has an ``image``
parameter of type image, and inpaint when it has a ``mask`` one too (``libs/workflow/capabilities.py``). The
files themselves do not go into the body: once the call is admitted they are decoded, checked and
stored (``inputs.resolve_inputs``, ``inputs.check_uploads``) from the bytes read here, and the body
holds their SHA-256 (what an ``Idempotency-Key`` compares).

Every file is read with a size limit as it streams in, so an oversized upload is refused at the
limit without being buffered whole; decoding happens off the event loop. The mask is converted to
the workflows' convention (diffusers' ``mask_image``: white repaints, black keeps) after its size
is checked against the first image's (``inputs.check_uploads``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import BodyPartReader, MultipartReader, web

from libs.workflow.capabilities import MAX_IMAGES, capabilities, image_params
from libs.workflow.spec import WorkflowSpec
from services.gateway.body import too_large
from services.gateway.errors import ApiError, invalid
from services.gateway.inputs import MAX_IMAGE_BYTES

MAX_FIELD_BYTES = 64 << 10  # any one text field; the prompt is held to the bus limit later
MAX_FIELDS = 64
INTS = {"n", "seed", "num_inference_steps", "output_compression"}
FLOATS = {"strength", "guidance_scale"}
TEXT = {"model", "prompt", "size", "response_format", "output_format", "background", "user", "quality"}
IGNORED = {"input_fidelity", "partial_images", "stream"}  # OpenAI's, with no meaning for these workflows


@dataclass
class EditForm:
    """The form as a generation body, and the files by the workflow parameter they fill."""

    body: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)


def can_inpaint(spec: WorkflowSpec) -> bool:
    return "inpaint" in capabilities(spec)


async def read_edit_form(request: web.Request) -> EditForm:
    """The parts of the form, checked field by field (400/413/415 naming the field)."""
    ctype = request.headers.get("Content-Type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise ApiError(
            415,
            "an edit is a multipart/form-data form (image, mask, prompt, model, …)",
            code="invalid_content_type",
        )
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as e:  # aiohttp: a malformed multipart header
        raise ApiError(400, f"malformed multipart form: {e}", code="invalid_form") from None
    body: dict[str, Any] = {}
    params: dict[str, Any] = {}
    images: list[bytes] = []
    mask: bytes | None = None
    fields = 0
    while True:
        try:
            part = await reader.next()
        except ValueError as e:
            raise ApiError(400, f"malformed multipart form: {e}", code="invalid_form") from None
        if part is None:
            break
        if isinstance(part, MultipartReader):
            raise ApiError(400, "nested multipart parts are not supported", code="invalid_form")
        fields += 1
        if fields > MAX_FIELDS:
            raise ApiError(400, f"a form of at most {MAX_FIELDS} fields", code="invalid_form")
        name = part.name or ""
        if name in ("image", "image[]"):
            if len(images) == MAX_IMAGES:
                raise invalid("image", f"at most {MAX_IMAGES} images in one edit")
            images.append(await _file(part, "image"))
        elif name == "mask":
            if mask is not None:
                raise invalid("mask", "give one mask")
            mask = await _file(part, "mask")
        elif name.startswith("params[") and name.endswith("]") and len(name) > 8:
            params[name[7:-1]] = _scalar(await _text(part, name))
        elif name == "params":
            params.update(_params_json(await _text(part, name)))
        elif name in INTS:
            body[name] = _int(name, await _text(part, name))
        elif name in FLOATS:
            body[name] = _float(name, await _text(part, name))
        elif name in TEXT:
            body[name] = await _text(part, name)
        elif name in IGNORED:
            await _text(part, name)
        else:
            raise invalid(name[:64] or "(unnamed)", "unknown field")
    if not images:
        raise invalid("image", "is required (the picture to edit)")
    if params:
        body["params"] = params
    files = {"image" if i == 0 else f"image_{i + 1}": raw for i, raw in enumerate(images)}
    if mask is not None:
        files["mask"] = mask
    return EditForm(body, files)


def bind_files(form: EditForm, spec: WorkflowSpec) -> None:
    """Check the files against ``spec`` and put their digests in the body's parameters: 400 when the
    workflow takes no image (or fewer images than given, or no mask and one was given)."""
    slots = image_params(spec)
    if not slots:
        raise invalid(
            "model", f"workflow {spec.name!r} takes no image: it cannot edit (see GET /v1/models)", status=400
        )
    given = [k for k in form.files if k != "mask"]
    if len(given) > len(slots):
        raise invalid(
            "image", f"workflow {spec.name!r} takes {len(slots)} image(s), got {len(given)}", status=400
        )
    if "mask" in form.files and not can_inpaint(spec):
        raise invalid("mask", f"workflow {spec.name!r} takes no mask (it edits the whole image)", status=400)
    params = form.body.setdefault("params", {})
    for name in form.files:
        if name in params:
            raise invalid(f"params.{name}", "is the uploaded file's; give the file instead")
        params[name] = "sha256:" + hashlib.sha256(form.files[name]).hexdigest()


async def _file(part: BodyPartReader, name: str) -> bytes:
    """A file part's bytes, refused (413) as soon as it passes the image size limit."""
    ctype = (part.headers.get("Content-Type") or "").lower()
    if ctype and not (ctype.startswith("image/") or ctype == "application/octet-stream"):
        raise invalid(name, f"must be an image file (image/png, image/jpeg, image/webp), got {ctype[:64]!r}")
    return await _read(part, name, MAX_IMAGE_BYTES)


async def _text(part: BodyPartReader, name: str) -> str:
    raw = await _read(part, name, MAX_FIELD_BYTES)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise invalid(name, "is not UTF-8 text") from None


async def _read(part: BodyPartReader, name: str, limit: int) -> bytes:
    buf = bytearray()
    while chunk := await part.read_chunk(1 << 16):
        buf += chunk
        if len(buf) > limit:
            raise too_large(name, limit, param=name)
    return bytes(buf)


def _int(name: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise invalid(name, f"must be an integer, got {text[:32]!r}") from None


def _float(name: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise invalid(name, f"must be a number, got {text[:32]!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise invalid(name, "must be a finite number")
    return value


def _scalar(text: str) -> Any:
    """A ``params[name]`` form value: JSON when it parses as a JSON scalar, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str | int | float | bool) or value is None else text


def _params_json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise invalid("params", "must be a JSON object of workflow parameters") from None
    if not isinstance(value, dict):
        raise invalid("params", "must be a JSON object of workflow parameters")
    return value
