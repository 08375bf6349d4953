"""The shape-counting task (the shape-counting seed's): generated images, "How many <shape> are in the image?", the
answer an integer. Rows are drawn by `data/shapes.py`; row i of a split depends only on (seed, i).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import datasets
from PIL import ImageColor

from vision_grpo.data import prepared, prompts_and_images, reading, shapes
from vision_grpo.data.prepared import ERROR
from vision_grpo.data.prompts_and_images import MAX_DECODE_PIXELS, PROMPT_FEATURE, make_example, normalize_image
from vision_grpo.rewards.counting import boxed_integer, final_answer

NAME = "shapes"
# The seed's three-part reward (weights 1 each unless `reward_weights` says otherwise).
DEFAULT_REWARDS = ["count_correct", "count_description", "count_reasoning"]


@dataclass
class Options:
    """Recipe keys of the shape-counting task."""

    shapes_layout: str = field(default="mixed", metadata={"help": "`mixed` (seed: all three shapes) or `single`."})
    shapes_canvas: int = field(default=256, metadata={"help": "Canvas side in pixels."})
    shapes_min_count: int = field(default=1, metadata={"help": "Fewest of a shape drawn."})
    shapes_max_count: int = field(default=5, metadata={"help": "Most of a shape drawn."})
    shapes_fixed_size: bool = field(default=False, metadata={"help": "One size per shape instead of random sizes."})
    shapes_train_size: int = field(default=500, metadata={"help": "Training images."})
    shapes_eval_size: int = field(default=100, metadata={"help": "Held-out images."})
    shapes_train_seed: int = field(default=1, metadata={"help": "Seed of the training images."})
    shapes_eval_seed: int = field(default=2, metadata={"help": "Seed of the held-out images (differs from train)."})
    # Looks out of the training distribution, for held-out variants (docs/demo.md, Experiment 5).
    shapes_fill_color: str | None = field(default=None, metadata={"help": "One colour for every shape (a name)."})
    shapes_size_range: list[int] | None = field(
        default=None, metadata={"help": "Half-width range of every shape in pixels, `[low, high]`."}
    )
    shapes_background: str = field(default="white", metadata={"help": "`white` or `noise` (grey noise)."})


FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "prompt": PROMPT_FEATURE,
        "shape": datasets.Value("string"),
        "answer": datasets.Value("int64"),
        "ground_truth": {name: datasets.Value("int64") for name in shapes.SHAPES},
        "index": datasets.Value("int64"),  # what the image is drawn from when the row is read
        ERROR: datasets.Value("string"),
    }
)


def check(task_args: Any) -> None:
    if task_args.shapes_layout not in ("mixed", "single"):
        raise ValueError(f"shapes_layout: {task_args.shapes_layout!r} is not one of ['mixed', 'single']")
    if task_args.shapes_canvas**2 > MAX_DECODE_PIXELS:  # drawn in memory before any other limit applies
        raise ValueError(f"shapes_canvas: {task_args.shapes_canvas}px squared exceeds {MAX_DECODE_PIXELS:,} pixels")
    if not 1 <= task_args.shapes_min_count <= task_args.shapes_max_count:
        raise ValueError("shapes_min_count must be >= 1 and <= shapes_max_count")
    if task_args.shapes_background not in ("white", "noise"):
        raise ValueError(f"shapes_background: {task_args.shapes_background!r} is not one of ['white', 'noise']")
    if task_args.shapes_fill_color is not None:
        try:
            ImageColor.getrgb(task_args.shapes_fill_color)
        except ValueError:
            raise ValueError(
                f"shapes_fill_color: {task_args.shapes_fill_color!r} is not a colour Pillow knows (a name such as "
                "`orange`, or `#rrggbb`)"
            ) from None
    if task_args.shapes_size_range is not None:
        _check_sizes(task_args)


def _check_sizes(task_args: Any) -> None:
    """`shapes_size_range` is [low, high] half-widths that fit the canvas: one shape at all, and without overlap the
    most shapes an image holds on at most half of it (a layout that cannot be found would fail at its row)."""
    sizes, canvas = task_args.shapes_size_range, task_args.shapes_canvas
    if len(sizes) != 2 or not 1 <= sizes[0] <= sizes[1]:
        raise ValueError(f"shapes_size_range: {sizes} must be [low, high] with 1 <= low <= high (pixels)")
    side = 2 * sizes[1] + 4  # a shape's box and its gap
    crowded = task_args.shapes_layout == "single" and task_args.shapes_max_count * side**2 > canvas**2 / 2
    if side > canvas or crowded:
        room = "one is wider than" if side > canvas else f"{task_args.shapes_max_count} of them need more than half"
        raise ValueError(
            f"shapes_size_range: shapes of half-width up to {sizes[1]}px do not fit: {room} of a {canvas}px canvas "
            "(shapes_canvas); lower the high end or raise shapes_canvas"
        )


def spec(task_args: Any) -> shapes.ShapeTaskSpec:
    """The recipe's `shapes_*` keys as a generator spec."""
    return shapes.ShapeTaskSpec(
        layout=task_args.shapes_layout,
        canvas=task_args.shapes_canvas,
        min_count=task_args.shapes_min_count,
        max_count=task_args.shapes_max_count,
        fixed_size=task_args.shapes_fixed_size,
        fill_color=task_args.shapes_fill_color,
        size_range=tuple(task_args.shapes_size_range) if task_args.shapes_size_range else None,
        background=task_args.shapes_background,
    )


def _check(row: dict[str, int], position: int, spec: dict, seed: int, max_pixels: int, code: str) -> dict[str, Any]:
    """The checking pass over one generated row: drawn and checked as training will see it, the image then dropped
    (it is drawn again, from its index, when the row is read); `code` is in the cache key, not used."""
    index = row["index"]
    example = shapes.make_example(shapes.ShapeTaskSpec(**spec), seed, index)
    row = make_example(
        f"{seed}-{index}",
        shapes.question_for(example.shape),
        example.image,
        "before_text",
        max_pixels,
        shape=example.shape,
        answer=example.answer,
        ground_truth=example.ground_truth,
    )
    return {**{key: value for key, value in row.items() if key != "image"}, "index": index, ERROR: None}


def _draw(batch: dict[str, list], spec: dict[str, Any], seed: int, max_pixels: int) -> dict[str, list]:
    """The transform at access: each row's image drawn from its index and normalised."""
    if "index" in batch:
        generator = shapes.ShapeTaskSpec(**spec)
        indices = batch.pop("index")
        batch["image"] = [normalize_image(shapes.make_example(generator, seed, i).image, max_pixels) for i in indices]
    return batch


def load(task_args: Any, split: str, max_pixels: int) -> datasets.Dataset:
    """`shapes_train_size` or `shapes_eval_size` rows drawn from the split's own seed; images drawn when read."""
    size = task_args.shapes_train_size if split == "train" else task_args.shapes_eval_size
    seed = task_args.shapes_train_seed if split == "train" else task_args.shapes_eval_seed
    indices = datasets.Dataset.from_dict({"index": list(range(size))})
    deciding = {"spec": asdict(spec(task_args)), "seed": seed, "max_pixels": max_pixels}
    code = prepared.code_digest(shapes, sys.modules[__name__], prompts_and_images)
    rows, _ = prepared.checked_rows(
        indices,
        _check,
        {**deciding, "code": code},
        FEATURES,
        f"shapes {split} ({size} drawn)",
        source_key=f"shapes:{size}",
    )
    return reading.decode_on_access(rows, functools.partial(_draw, **deciding))


def score(row: dict[str, Any], text: str) -> dict[str, Any]:
    """Strict: the last `\\boxed{N}`. Lenient: the final answer however written (last box, else last integer)."""
    strict = boxed_integer(text)
    lenient = final_answer(text)
    gold = int(row["answer"])
    return {
        "gold": str(gold),
        "prediction": None if strict is None else str(strict.value),
        "correct": strict is not None and strict.value == gold,
        "lenient_prediction": None if lenient is None else str(lenient.value),
        "lenient_correct": lenient is not None and lenient.value == gold,
        "shape": row["shape"],
    }


def identity(task_args: Any) -> dict[str, Any]:
    """The generator's settings and seeds (its code is the manifest's git commit)."""
    return {
        "name": "shapes (generated by data/shapes.py)",
        "revision": None,
        "generator": asdict(spec(task_args)),
        "train": {"seed": task_args.shapes_train_seed, "size": task_args.shapes_train_size},
        "eval": {"seed": task_args.shapes_eval_seed, "size": task_args.shapes_eval_size},
    }
