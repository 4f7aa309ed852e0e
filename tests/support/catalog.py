"""What the catalog's end-to-end tests share (``tests/e2e/conftest.py`` holds their fixtures): the
catalog stack's API key and weight budget, and the calls and pictures its tests send and read."""

from __future__ import annotations

import base64
import io

import numpy as np
import redis
from PIL import Image

from libs.launcher.stack import Stack
from libs.protocol.keys import Keys

KEY = "sk-cat"
BUDGET_MB = 1


def png_b64(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def control_picture(w: int, h: int) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def pixels(b64: str) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(base64.b64decode(b64))))


def state(stack: Stack, gen_id: str) -> dict[str, str]:
    r = redis.Redis.from_url(stack.redis_url)
    try:
        raw = r.hgetall(Keys(stack.namespace).request(f"{gen_id}-0"))
        return {k.decode(): v.decode() for k, v in raw.items()}
    finally:
        r.close()


def edit(stack: Stack, files: dict[str, Image.Image], **fields) -> dict:
    """``POST /v1/images/edits`` with ``files`` as PNG parts and ``fields`` as text parts."""
    import httpx

    parts = []
    for name, img in files.items():
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        parts.append((name, (f"{name}.png", buf.getvalue(), "image/png")))
    resp = httpx.post(
        f"{stack.url}/v1/images/edits",
        data={k: str(v) for k, v in fields.items()},
        files=parts,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=300,
    )
    assert resp.status_code == 200, (resp.text, stack.tail("scheduler"))
    return resp.json()
