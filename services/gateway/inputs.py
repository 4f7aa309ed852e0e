"""Workflow parameters that are not plain scalars: pictures and LoRA adapters.

* ``image`` (a ControlNet's control image): base64 PNG or JPEG in the request (a ``data:`` URL is
  accepted too). It is decoded and checked here — real image data, sane dimensions, a size
  limit — normalised to an RGB PNG and put in the images bucket. Executors fetch it from there,
  since pictures can exceed NATS' 1 MiB payload limit. The parameter then carries the object's name.
  Decoding runs in a worker thread (at most ``DECODE_SLOTS`` at once per gateway, which bounds the
  memory decoded pictures take), never on the event loop; a picture's header is checked against
  :data:`MAX_PIXELS` before any pixel is decoded.
* ``lora``: the name of a registered adapter (``POST /v1/loras``), replaced by its path. An
  unknown name is refused here, before anything reaches the scheduler.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
from collections.abc import Mapping
from typing import Any

from libs.workflow.spec import WorkflowSpec
from services.gateway.bridge import Bridge
from services.gateway.errors import invalid

MAX_IMAGE_BYTES = 16 << 20
MAX_SIDE = 4096
MIN_SIDE = 8
MAX_PIXELS = 1 << 23  # 8.4 megapixels (e.g. 4096x2048): ~25 MB once decoded to RGB
DECODE_SLOTS = 4
MAX_LORA_NAME = 64
DATA_URL = re.compile(r"^data:image/[a-z+.-]+;base64,", re.I)


def field_name(param: str, body: dict[str, Any]) -> str:
    return f"params.{param}" if param in body.get("params", {}) else param


def decode_image(field: str, value: str) -> bytes:
    """A base64 picture -> RGB PNG bytes, or a 422 naming ``field``."""
    raw_b64 = DATA_URL.sub("", value.strip(), count=1)
    if len(raw_b64) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise invalid(field, f"image is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        raw = base64.b64decode(raw_b64, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(field, "is not base64-encoded image data") from None
    return check_image(field, raw)


def check_image(field: str, raw: bytes) -> bytes:
    """A picture's bytes -> RGB PNG bytes, or a 422 naming ``field``: a PNG, JPEG or WebP of sane
    dimensions (checked from its header before any pixel is decoded), decoded in full."""
    from PIL import Image, UnidentifiedImageError

    if len(raw) > MAX_IMAGE_BYTES:
        raise invalid(field, f"image is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.format not in ("PNG", "JPEG", "WEBP"):
                raise invalid(field, f"must be a PNG, JPEG or WebP image, got {img.format}")
            w, h = img.size
            if not (MIN_SIDE <= w <= MAX_SIDE and MIN_SIDE <= h <= MAX_SIDE):
                raise invalid(field, f"image is {w}x{h}; each side must be {MIN_SIDE}..{MAX_SIDE} pixels")
            if w * h > MAX_PIXELS:
                raise invalid(field, f"image is {w}x{h}; at most {MAX_PIXELS} pixels")
            img.load()  # decode fully: truncated or corrupt data fails here, not on an executor
            out = io.BytesIO()
            img.convert("RGB").save(out, format="PNG")
            return out.getvalue()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise invalid(field, f"is not a readable image ({type(e).__name__})") from None


def check_uploads(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """An edit's uploaded files as RGB PNGs, decoded and checked (run it in a worker thread): 422
    naming the field for a file that is not a readable image of sane size; the mask (OpenAI's:
    fully transparent pixels repaint) as the workflows take it (diffusers' ``mask_image``: white
    repaints, black keeps), 422 when its size is not the image's. A mask with no alpha channel is
    taken as being in the workflows' convention already."""
    out = {name: check_image(name, raw) for name, raw in files.items() if name != "mask"}
    raw = files.get("mask")
    if raw is not None:
        out["mask"] = _mask(raw, _size(out["image"]))
    return out


def _size(png: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as img:
        return img.size


def _mask(raw: bytes, size: tuple[int, int]) -> bytes:
    from PIL import Image

    check_image("mask", raw)  # readable, of sane size: the image's checks
    with Image.open(io.BytesIO(raw)) as img:
        if img.size != size:
            w, h = img.size
            raise invalid("mask", f"is {w}x{h}; it must be the size of the image, {size[0]}x{size[1]}")
        if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
            out = img.convert("RGBA").getchannel("A").point(lambda a: 255 if a == 0 else 0)
        else:
            out = img.convert("L")
        buf = io.BytesIO()
        out.convert("RGB").save(buf, format="PNG")
        return buf.getvalue()


async def resolve_inputs(
    spec: WorkflowSpec,
    params: list[dict[str, Any]],
    body: dict[str, Any],
    bridge: Bridge,
    gen_id: str,
    slots: asyncio.Semaphore,
    files: Mapping[str, bytes] | None = None,
) -> dict[str, str]:
    """Replace image and LoRA parameters in every image's parameters, in place. ``files``: image
    parameters uploaded as files (an edit's: :func:`check_uploads` decodes and checks them here)
    instead of given as base64.

    Returns resolved LoRA path -> LoRA name (paths are never shown to tenants).
    """
    loras: dict[str, str] = {}
    if files:
        async with slots:
            files = await asyncio.to_thread(check_uploads, files)
    for name, p in spec.params.items():
        if p.type not in ("image", "lora"):
            continue
        value = params[0].get(name)
        if not value:
            continue
        field = field_name(name, body)
        if p.type == "lora":
            # A registered name is a short slug; a longer value could not even be asked for on the bus.
            lora = await bridge.registry.lora(value) if len(value) <= MAX_LORA_NAME else None
            if lora is None:
                raise invalid(field, f"unknown LoRA {value[:64]!r} (register it with POST /v1/loras)")
            resolved = lora.path
            loras[lora.path] = lora.name
        else:
            if files is not None and name in files:
                png = files[name]
            else:
                async with slots:
                    png = await asyncio.to_thread(decode_image, field, value)
            resolved = f"inputs/{gen_id}/{name}.png"
            await bridge.put_image(resolved, png)
        for one in params:
            one[name] = resolved
    return loras
