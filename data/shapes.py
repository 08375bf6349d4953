"""Synthetic shape-counting images: red triangles, blue circles, green squares (the shape-counting seed's generator).

Two layouts share one drawing routine:
- `mixed` (the seed's): all three shapes, `count_range` of each, placed anywhere, overlaps allowed, 256x256.
- `single`: only the asked shape is drawn, without overlaps, so that a tiny model on a CPU can learn to count it in
  minutes (the demo's task). Everything else about the drawing is identical.

Each example is drawn from its own `random.Random(f"{seed}:{index}")`, so an example depends only on the split's seed
and its index: train and held-out sets use different seeds and never share a random stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageColor, ImageDraw

SHAPES = ("triangles", "circles", "squares")
COLORS = {"triangles": ("red", "darkred"), "circles": ("blue", "darkblue"), "squares": ("green", "darkgreen")}
# The seed's size ranges in pixels, the same on every canvas (a shape must stay countable at 14-pixel patches).
SIZE_RANGES = {"triangles": (15, 35), "circles": (10, 25), "squares": (12, 28)}
SEED_CANVAS = 256
MAX_PLACEMENT_TRIES = 200
MAX_LAYOUT_RESTARTS = 50


@dataclass(frozen=True)
class ShapeTaskSpec:
    """What a shape-counting split looks like; a recipe's `shapes_*` keys fill it."""

    layout: Literal["mixed", "single"] = "mixed"
    canvas: int = SEED_CANVAS
    min_count: int = 1
    max_count: int = 5
    # One size per shape (the middle of the seed's range) instead of the seed's random sizes: then the count is
    # proportional to the coloured area, which a tiny CPU model can learn in minutes (the demo's choice).
    fixed_size: bool = False
    # Looks that held-out sets out of distribution change (docs/demo.md, Experiment 5); the defaults are the seed's.
    fill_color: str | None = None  # one Pillow colour for every shape (None: red triangles, blue circles, ...)
    size_range: tuple[int, int] | None = None  # every shape's half-width in pixels (None: the seed's, per shape)
    background: Literal["white", "noise"] = "white"  # noise: grey noise drawn after the layout (the same shapes)

    def sizes(self, shape: str) -> tuple[int, int]:
        """The half-widths `shape` is drawn at, lowest and highest."""
        low, high = self.size_range or SIZE_RANGES[shape]
        return ((low + high) // 2,) * 2 if self.fixed_size else (low, high)


@dataclass(frozen=True)
class ShapeExample:
    """One drawn example: the question's shape, the answer, and the counts of all three shapes."""

    image: Image.Image
    shape: str
    answer: int
    ground_truth: dict[str, int]


def question_for(shape: str) -> str:
    """The seed's question, e.g. "How many circles are in the image?"."""
    return f"How many {shape} are in the image?"


def _bbox(shape: str, x: int, y: int, size: int) -> tuple[int, int, int, int]:
    return (x - size, y - size, x + size, y + size)


def _overlaps(box: tuple[int, int, int, int], others: list[tuple[int, int, int, int]]) -> bool:
    return any(box[0] <= o[2] and o[0] <= box[2] and box[1] <= o[3] and o[1] <= box[3] for o in others)


def _colors(shape: str, fill_color: str | None) -> tuple[str | tuple[int, ...], str | tuple[int, ...]]:
    """Fill and outline: the seed's pair, or `fill_color` with a darker outline as the seed's (its channels x 0.55;
    Pillow leaves out a polygon's outline where it equals the fill, which would draw other pixels)."""
    if fill_color is None:
        return COLORS[shape]
    return fill_color, tuple(int(channel * 0.55) for channel in ImageColor.getrgb(fill_color)[:3])


def _draw(draw: ImageDraw.ImageDraw, shape: str, x: int, y: int, size: int, fill_color: str | None) -> None:
    fill, outline = _colors(shape, fill_color)
    if shape == "triangles":
        draw.polygon([(x, y - size), (x - size, y + size), (x + size, y + size)], fill=fill, outline=outline)
    elif shape == "circles":
        draw.ellipse([(x - size, y - size), (x + size, y + size)], fill=fill, outline=outline)
    else:
        draw.rectangle([(x - size, y - size), (x + size, y + size)], fill=fill, outline=outline)


Placement = tuple[str, int, int, int]  # shape, centre x, centre y, size


def _layout(counts: dict[str, int], rng: random.Random, spec: ShapeTaskSpec) -> list[Placement] | None:
    """Positions and sizes for every shape, or None when a non-overlapping layout got stuck (caller restarts)."""
    margin, canvas, allow_overlap = 20, spec.canvas, spec.layout == "mixed"
    placements: list[Placement] = []
    boxes: list[tuple[int, int, int, int]] = []
    for shape in SHAPES:
        low, high = spec.sizes(shape)
        if counts.get(shape, 0) and canvas < 2 * (high + 2):  # else placement has no room at all
            raise ValueError(f"a {canvas}px canvas is too small for {shape} of up to {high}px; use {2 * (high + 2)}px+")
        for _ in range(counts.get(shape, 0)):
            for _ in range(MAX_PLACEMENT_TRIES):
                size = rng.randint(low, high)
                if allow_overlap:
                    x, y = rng.randint(margin, canvas - margin), rng.randint(margin, canvas - margin)
                else:  # keep the whole shape on the canvas and apart from the others
                    x, y = rng.randint(size + 1, canvas - size - 2), rng.randint(size + 1, canvas - size - 2)
                box = _bbox(shape, x, y, size + 1)
                if allow_overlap or not _overlaps(box, boxes):
                    break
            else:
                return None
            boxes.append(box)
            placements.append((shape, x, y, size))
    return placements


def _background(spec: ShapeTaskSpec, rng: random.Random) -> Image.Image:
    """The canvas: white, or grey noise (values 150-255 per pixel) from a seed drawn after the layout, so that a noisy
    image holds the same shapes in the same places as its white twin."""
    if spec.background == "white":
        return Image.new("RGB", (spec.canvas, spec.canvas), "white")
    grey = np.random.default_rng(rng.getrandbits(32)).integers(150, 256, (spec.canvas, spec.canvas), dtype=np.uint8)
    return Image.fromarray(grey, mode="L").convert("RGB")


def draw_shapes(counts: dict[str, int], rng: random.Random, spec: ShapeTaskSpec) -> Image.Image:
    """Draw `counts[shape]` of each shape on the spec's canvas, in the seed's order (triangles, circles, squares).

    Without overlap, a layout whose first shapes leave no room for the rest is started again, a bounded number of
    times, so crowded images are possible but an impossible request fails instead of looping.
    """
    for _ in range(MAX_LAYOUT_RESTARTS):
        placements = _layout(counts, rng, spec)
        if placements is not None:
            break
    else:
        raise ValueError(f"cannot place {counts} without overlap on a {spec.canvas}px canvas; use a larger canvas")
    image = _background(spec, rng)
    draw = ImageDraw.Draw(image)
    for shape, x, y, size in placements:
        _draw(draw, shape, x, y, size, spec.fill_color)
    return image


def make_example(spec: ShapeTaskSpec, seed: int | str, index: int) -> ShapeExample:
    """Example `index` of the split with `seed`: deterministic, independent of every other example."""
    rng = random.Random(f"{seed}:{index}")
    shape = SHAPES[rng.randrange(len(SHAPES))]
    if spec.layout == "mixed":
        counts = {s: rng.randint(spec.min_count, spec.max_count) for s in SHAPES}
    else:
        counts = {s: 0 for s in SHAPES}
        counts[shape] = rng.randint(spec.min_count, spec.max_count)
    image = draw_shapes(counts, rng, spec)
    return ShapeExample(image=image, shape=shape, answer=counts[shape], ground_truth=counts)
