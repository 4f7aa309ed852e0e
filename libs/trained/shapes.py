"""The procedural data set: captioned 64x64 RGB scenes of one or two flat shapes, drawn from a seed.

A scene (:class:`Scene`) is a shape (circle, square, triangle), a colour (red, green, blue,
yellow, purple), a position (left, right, top, bottom, center), a background (white, black, grey)
and a count (one, two). Its caption follows one grammar::

    a red circle on the left on a white background
    two blue triangles at the top on a grey background
    a yellow square in the center on a black background

:func:`parse_caption` reads such a caption back (the evaluator's ground truth).

Drawing (:func:`draw`) uses PIL without anti-aliasing. One shape has a bounding box of 18-24 px;
two shapes (the same shape and colour) are 12-15 px each, side by side (stacked for left / right)
with their pair's centre at the position. Positions are the centres (16, 32), (48, 32), (32, 16),
(32, 48) and (32, 32) in (x, y), jittered by up to 3 px; sizes and jitter come from the image's own
generator, ``numpy.random.default_rng([seed, index])``, so image ``index`` of a seed is the same
whatever else is drawn.

The split: the 450 attribute combinations are permuted by a fixed generator and 45 of them
(:data:`HELD_OUT`, 10%) never appear in training (:data:`TRAIN`); the evaluation of the trained
model prompts with held-out captions only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

SIZE = 64
SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 210, 40),
    "purple": (150, 60, 190),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "grey": (128, 128, 128),
}
POSITIONS: dict[str, tuple[str, tuple[int, int]]] = {  # name -> (phrase, centre (x, y))
    "left": ("on the left", (16, 32)),
    "right": ("on the right", (48, 32)),
    "top": ("at the top", (32, 16)),
    "bottom": ("at the bottom", (32, 48)),
    "center": ("in the center", (32, 32)),
}
COUNTS = ("one", "two")
SPLIT_SEED = 20261202
N_HELD_OUT = 45


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    position: str
    background: str
    count: str

    @property
    def caption(self) -> str:
        return caption(self)


def caption(scene: Scene) -> str:
    noun = scene.shape if scene.count == "one" else scene.shape + "s"
    article = "a" if scene.count == "one" else "two"
    phrase = POSITIONS[scene.position][0]
    return f"{article} {scene.colour} {noun} {phrase} on a {scene.background} background"


def parse_caption(text: str) -> Scene:
    """The scene a caption of the grammar describes; ValueError for any other text."""
    words = text.strip().lower().split()
    if len(words) != 10 or words[6:8] != ["on", "a"] or words[9] != "background":
        raise ValueError(f"not a caption of the shapes grammar: {text!r}")
    count = {"a": "one", "two": "two"}.get(words[0])
    noun = words[2] if count == "one" else words[2].removesuffix("s")
    if count == "two" and not words[2].endswith("s"):
        noun = ""
    position = next((p for p, (phrase, _) in POSITIONS.items() if phrase.split() == words[3:6]), None)
    scene = (noun, words[1], position, words[8], count)
    if (
        count is None
        or noun not in SHAPES
        or words[1] not in COLOURS
        or position is None
        or words[8] not in BACKGROUNDS
    ):
        raise ValueError(f"not a caption of the shapes grammar: {text!r}")
    return Scene(*scene)  # type: ignore[arg-type]


def all_scenes() -> list[Scene]:
    return [Scene(*combo) for combo in itertools.product(SHAPES, COLOURS, POSITIONS, BACKGROUNDS, COUNTS)]


def _split() -> tuple[list[Scene], list[Scene]]:
    scenes = all_scenes()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(scenes))
    held = sorted(int(i) for i in order[:N_HELD_OUT])
    train = sorted(int(i) for i in order[N_HELD_OUT:])
    return [scenes[i] for i in train], [scenes[i] for i in held]


TRAIN, HELD_OUT = _split()


def _boxes(scene: Scene, rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """(centre x, centre y, size) of each shape of ``scene``."""
    cx, cy = POSITIONS[scene.position][1]
    cx += int(rng.integers(-3, 4))
    cy += int(rng.integers(-3, 4))
    if scene.count == "one":
        return [(cx, cy, int(rng.integers(18, 25)))]
    size = int(rng.integers(12, 16))
    half = size // 2 + 3  # a gap of ~6 px between the two
    if scene.position in ("left", "right"):
        return [(cx, cy - half, size), (cx, cy + half, size)]
    return [(cx - half, cy, size), (cx + half, cy, size)]


def draw(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """The scene as uint8 [64, 64, 3]; sizes and jitter drawn from ``rng``."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), BACKGROUNDS[scene.background])
    pen = ImageDraw.Draw(img)
    fill = COLOURS[scene.colour]
    for cx, cy, s in _boxes(scene, rng):
        x0, y0 = cx - s // 2, cy - s // 2
        x1, y1 = x0 + s - 1, y0 + s - 1
        if scene.shape == "circle":
            pen.ellipse([x0, y0, x1, y1], fill=fill)
        elif scene.shape == "square":
            pen.rectangle([x0, y0, x1, y1], fill=fill)
        else:
            pen.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)
    return np.asarray(img, dtype=np.uint8).copy()


def sample(index: int, seed: int, scenes: list[Scene] | None = None) -> tuple[Scene, np.ndarray]:
    """Image ``index`` of data set ``seed``: a scene drawn uniformly from ``scenes`` (default
    :data:`TRAIN`) and its picture, both from ``default_rng([seed, index])``."""
    pool = TRAIN if scenes is None else scenes
    rng = np.random.default_rng([seed, index])
    scene = pool[int(rng.integers(len(pool)))]
    return scene, draw(scene, rng)


def dataset(n: int, seed: int, scenes: list[Scene] | None = None) -> tuple[list[Scene], np.ndarray]:
    """Images 0..n-1 of data set ``seed``: their scenes and uint8 [n, 64, 64, 3]."""
    pairs = [sample(i, seed, scenes) for i in range(n)]
    return [s for s, _ in pairs], np.stack([img for _, img in pairs])
