"""The pictures a node run reads and writes: an ``image`` input decoded from the PNG the gateway
stored, and a workflow's image output encoded as the PNG the executor uploads."""

from __future__ import annotations

import io
from typing import Any

import torch

from services.executor.outcome import NodeError, Png


def decode_image(data: bytes | None, name: str) -> Any:
    """An ``image`` input: the PNG the gateway validated and stored, as an RGB ``PIL.Image``."""
    from PIL import Image

    if data is None:
        raise NodeError(f"image {name!r} is missing from the images bucket (expired?)")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:
        raise NodeError(f"image {name!r} cannot be decoded: {e}") from e
    return img.convert("RGB")


def encode_png(image: torch.Tensor) -> Png:
    """A uint8 [H, W, 3] (or [1, H, W, 3]) tensor -> PNG bytes."""
    from PIL import Image

    if image.dim() == 4 and image.shape[0] == 1:
        image = image[0]
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[-1] not in (1, 3, 4):
        raise NodeError(
            f"a workflow image output must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}"
        )
    arr = image.detach().cpu().contiguous().numpy()
    if arr.shape[-1] == 1:
        arr = arr[..., 0]
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return Png(buf.getvalue(), width=arr.shape[1], height=arr.shape[0])
