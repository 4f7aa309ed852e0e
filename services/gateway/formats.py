"""Output formats: executors store PNGs; the gateway hands out PNG, JPEG or WebP.

Executors always encode PNG (lossless, so an image can be checked and re-encoded without loss).
A call that asks for ``output_format: jpeg`` or ``webp`` gets the PNG transcoded here, at the
gateway, when its answer is built (``b64_json``) or its file is fetched (``url``). Transcoding is
CPU work of tens of milliseconds per megapixel, so it runs in a worker thread and under the
gateway's decode slots (the same bound as decoding control images): a burst of calls cannot take
every thread or stall the event loop.
"""

from __future__ import annotations

import asyncio
import io

from PIL import Image

OUTPUT_FORMATS = ("png", "jpeg", "webp")
CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
# OpenAI's default for ``output_compression``: it acts as the encoder's quality (100 = best).
DEFAULT_COMPRESSION = 100
# An executor's PNG is ours, but a bound keeps a broken one from taking the gateway's memory.
MAX_PIXELS = 64 * 1024 * 1024


def suffix_format(name: str) -> str | None:
    """The output format a file name asks for by its suffix (``.png``, ``.jpeg``/``.jpg``, ``.webp``)."""
    stem, dot, ext = name.rpartition(".")
    if not dot or not stem:
        return None
    ext = ext.lower()
    return "jpeg" if ext == "jpg" else ext if ext in OUTPUT_FORMATS else None


def encode_as(png: bytes, fmt: str, compression: int = DEFAULT_COMPRESSION) -> bytes:
    """``png`` re-encoded as ``fmt`` (PNG bytes are returned as they are)."""
    if fmt == "png":
        return png
    if fmt not in OUTPUT_FORMATS:
        raise ValueError(f"unknown output format {fmt!r}")
    with Image.open(io.BytesIO(png)) as img:
        if img.width * img.height > MAX_PIXELS:
            raise ValueError(f"image of {img.width}x{img.height} is too large to transcode")
        # JPEG has no alpha; WebP keeps it.
        rgb = img.convert("RGBA" if fmt == "webp" and "A" in img.getbands() else "RGB")
    buf = io.BytesIO()
    if fmt == "jpeg":
        rgb.save(buf, format="JPEG", quality=max(1, min(compression, 100)), optimize=True)
    else:
        rgb.save(buf, format="WEBP", quality=compression, method=4)
    return buf.getvalue()


async def transcode(png: bytes, fmt: str, compression: int, slots: asyncio.Semaphore) -> bytes:
    """``encode_as`` off the event loop, at most ``slots`` at a time."""
    if fmt == "png":
        return png
    async with slots:
        return await asyncio.to_thread(encode_as, png, fmt, compression)
