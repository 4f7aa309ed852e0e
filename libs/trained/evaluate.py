"""A deterministic scorer of a 64x64 image against its shapes caption (:mod:`libs.trained.shapes`).

Analytic, no learned parts (numpy only), applied to an RGB image of any size (it is resized to
64x64 first, bilinear, when it is not):

* **background**: the per-channel median of the 1-px border, named by the nearest background
  colour (RGB distance);
* **foreground**: the pixels farther than :data:`FG_DISTANCE` (RGB, L2) from that median; its
  4-connected components of at least :data:`MIN_AREA` pixels are the objects;
* **count**: the number of objects (one or two; any other number matches no caption);
* **colour**: the per-channel median of the objects' pixels, named by the nearest shape colour;
* **position**: the centroid of the objects' pixels relative to the image centre: within
  :data:`CENTER_RADIUS` px on both axes is center, else the dominant axis gives left / right /
  top / bottom;
* **shape**, per object, from its bounding box: a triangle (pointing up) has most of its pixels in
  the lower half of the box (:data:`TRIANGLE_LOWER`), a square fills its box
  (:data:`SQUARE_FILL`), a circle fills ~79%; the image's shape is the objects' common one.

:func:`score` returns a :class:`Verdict`: the predicted attributes, and per attribute whether it
matches the caption; ``all`` is the conjunction.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from libs.trained.shapes import BACKGROUNDS, COLOURS, SIZE, Scene, parse_caption

FG_DISTANCE = 48.0
MIN_AREA = 12
CENTER_RADIUS = 8.0
TRIANGLE_LOWER = 0.64
SQUARE_FILL = 0.89
ATTRIBUTES = ("shape", "colour", "position", "background", "count")


@dataclass(frozen=True)
class Verdict:
    caption: str
    predicted: dict[str, str | None]
    matches: dict[str, bool] = field(default_factory=dict)

    @property
    def all(self) -> bool:
        return all(self.matches.values())

    def summary(self) -> str:
        marks = ", ".join(
            f"{a} {'ok' if self.matches[a] else 'WRONG'} ({self.predicted[a]})" for a in ATTRIBUTES
        )
        return f"{'matches' if self.all else 'does not match'} {self.caption!r}: {marks}"


def _as_array(image: Any) -> np.ndarray:
    """uint8-range float [64, 64, 3] of a PIL image or an array (uint8 [H, W, 3])."""
    from PIL import Image

    if isinstance(image, Image.Image):
        pil = image.convert("RGB")
    else:
        pil = Image.fromarray(np.asarray(image, dtype=np.uint8)).convert("RGB")
    if pil.size != (SIZE, SIZE):
        pil = pil.resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(pil, dtype=np.float64)


def _nearest(colour: np.ndarray, palette: dict[str, tuple[int, int, int]]) -> str:
    return min(palette, key=lambda name: float(np.sum((colour - np.asarray(palette[name])) ** 2)))


def components(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected components of a boolean mask, each as an int array of (y, x), in raster
    order of their first pixel."""
    h, w = mask.shape
    seen = np.zeros_like(mask, dtype=bool)
    out = []
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        queue, pixels = deque([(int(y0), int(x0))]), []
        while queue:
            y, x = queue.popleft()
            pixels.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        out.append(np.asarray(pixels, dtype=np.int64))
    return out


def shape_of(pixels: np.ndarray) -> str:
    """circle, square or triangle, from one object's pixels ((y, x) rows)."""
    ys, xs = pixels[:, 0], pixels[:, 1]
    y0, y1, x0, x1 = ys.min(), ys.max(), xs.min(), xs.max()
    fill = len(pixels) / float((y1 - y0 + 1) * (x1 - x0 + 1))
    lower = float(np.mean(ys > (y0 + y1) / 2.0))
    if lower >= TRIANGLE_LOWER:
        return "triangle"
    return "square" if fill >= SQUARE_FILL else "circle"


def _position(cx: float, cy: float) -> str:
    dx, dy = cx - (SIZE - 1) / 2.0, cy - (SIZE - 1) / 2.0
    if abs(dx) < CENTER_RADIUS and abs(dy) < CENTER_RADIUS:
        return "center"
    if abs(dx) >= abs(dy):
        return "left" if dx < 0 else "right"
    return "top" if dy < 0 else "bottom"


def predict(image: Any) -> dict[str, str | None]:
    """The attributes read off ``image`` (None where there is nothing to read)."""
    img = _as_array(image)
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    bg = np.median(border, axis=0)
    mask = np.sqrt(np.sum((img - bg) ** 2, axis=-1)) > FG_DISTANCE
    objects = [c for c in components(mask) if len(c) >= MIN_AREA]
    out: dict[str, str | None] = {a: None for a in ATTRIBUTES}
    out["background"] = _nearest(bg, BACKGROUNDS)
    out["count"] = {1: "one", 2: "two"}.get(len(objects), str(len(objects)))
    if not objects:
        return out
    pixels = np.concatenate(objects)
    out["colour"] = _nearest(np.median(img[pixels[:, 0], pixels[:, 1]], axis=0), COLOURS)
    out["position"] = _position(float(pixels[:, 1].mean()), float(pixels[:, 0].mean()))
    kinds = {shape_of(c) for c in objects}
    out["shape"] = kinds.pop() if len(kinds) == 1 else "mixed"
    return out


def score(image: Any, caption: str) -> Verdict:
    """Does ``image`` show ``caption`` (a caption of the shapes grammar)? Per attribute."""
    truth: Scene = parse_caption(caption)
    predicted = predict(image)
    matches = {a: predicted[a] == getattr(truth, a) for a in ATTRIBUTES}
    return Verdict(caption, predicted, matches)


def accuracy(verdicts: list[Verdict]) -> dict[str, float]:
    """The fraction of verdicts matching per attribute, and ``all`` (every attribute)."""
    n = max(len(verdicts), 1)
    acc = {a: sum(v.matches[a] for v in verdicts) / n for a in ATTRIBUTES}
    acc["all"] = sum(v.all for v in verdicts) / n
    return acc
