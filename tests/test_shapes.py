"""The shape generator draws exactly what it stores, deterministically, with the configured count range.

Counting is checked on the pixels: each shape has its own fill and outline colours, so the connected components of a
shape's colours are its drawn instances wherever shapes cannot overlap (the `single` layout).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np
import pytest
from PIL import ImageColor
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.shapes import COLORS, SHAPES, ShapeTaskSpec, make_example, question_for
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe

WHITE = (255, 255, 255)


def colour_masks(image) -> dict[str, np.ndarray]:
    """Per shape, the pixels painted in its fill or outline colour."""
    pixels = np.asarray(image)
    masks = {}
    for shape, colours in COLORS.items():
        mask = np.zeros(pixels.shape[:2], dtype=bool)
        for colour in colours:
            mask |= (pixels == np.array(ImageColor.getrgb(colour))).all(axis=-1)
        masks[shape] = mask
    return masks


def foreign_pixels(image) -> int:
    """Pixels that are neither background nor one of the shapes' colours (anti-aliasing would create them)."""
    known = np.any(list(colour_masks(image).values()), axis=0) | (np.asarray(image) == WHITE).all(axis=-1)
    return int((~known).sum())


def components(mask: np.ndarray) -> int:
    """Number of 4-connected components of a boolean mask."""
    seen = np.zeros_like(mask)
    height, width = mask.shape
    count = 0
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        count += 1
        seen[y, x] = True
        queue = deque([(y, x)])
        while queue:
            cy, cx = queue.popleft()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
    return count


@pytest.mark.parametrize(("canvas", "low", "high", "n"), [(140, 1, 3, 20), (256, 1, 5, 10), (256, 6, 7, 8)])
def test_single_layout_draws_exactly_the_stored_counts(canvas: int, low: int, high: int, n: int) -> None:
    spec = ShapeTaskSpec(layout="single", canvas=canvas, min_count=low, max_count=high)
    for index in range(n):
        example = make_example(spec, seed=1, index=index)
        drawn = {shape: components(mask) for shape, mask in colour_masks(example.image).items()}
        assert drawn == example.ground_truth, f"example {index}"
        assert example.answer == example.ground_truth[example.shape]
        assert [s for s in SHAPES if example.ground_truth[s] > 0] == [example.shape]
        assert example.image.size == (canvas, canvas)
        assert foreign_pixels(example.image) == 0


def test_mixed_layout_is_consistent() -> None:
    """Overlaps are allowed, so exact counts cannot be read back; check what can be checked."""
    spec = ShapeTaskSpec(layout="mixed")
    for index in range(20):
        example = make_example(spec, seed=1, index=index)
        masks = colour_masks(example.image)
        assert example.shape in SHAPES
        assert example.answer == example.ground_truth[example.shape]
        assert set(example.ground_truth) == set(SHAPES)
        assert all(1 <= count <= 5 for count in example.ground_truth.values())
        # Every shape is present with count >= 1 (on these fixed examples none is fully hidden by a later one).
        assert all(masks[shape].any() for shape in SHAPES), f"example {index}"
        # Squares are drawn last and never covered: overlaps can only merge them, never add components.
        assert 1 <= components(masks["squares"]) <= example.ground_truth["squares"]
        assert foreign_pixels(example.image) == 0


def test_examples_are_deterministic_per_seed_and_index() -> None:
    spec = ShapeTaskSpec(layout="mixed")
    first = make_example(spec, seed=7, index=3)
    make_example(spec, seed=7, index=4)  # drawing other examples in between must not matter
    again = make_example(spec, seed=7, index=3)
    assert first.image.tobytes() == again.image.tobytes()
    assert (first.shape, first.answer, first.ground_truth) == (again.shape, again.answer, again.ground_truth)


@pytest.mark.parametrize("layout", ["mixed", "single"])
def test_train_and_eval_seeds_give_different_images(layout: str) -> None:
    spec = ShapeTaskSpec(layout=layout, canvas=140, max_count=3)
    train = [make_example(spec, seed=1, index=i).image.tobytes() for i in range(10)]
    held_out = [make_example(spec, seed=2, index=i).image.tobytes() for i in range(10)]
    assert not set(train) & set(held_out)
    assert len(set(train)) == len(train)


@pytest.mark.parametrize("layout", ["mixed", "single"])
def test_count_range_is_configurable_for_out_of_distribution_sets(layout: str) -> None:
    spec = ShapeTaskSpec(layout=layout, min_count=6, max_count=7)
    answers = [make_example(spec, seed=3, index=i).answer for i in range(30)]
    assert set(answers) == {6, 7}


@pytest.mark.parametrize(
    ("layout", "canvas", "count", "message"),
    [("single", 140, 30, "without overlap"), ("single", 50, 1, "too small"), ("mixed", 40, 1, "too small")],
)
def test_impossible_layouts_fail_clearly(layout: str, canvas: int, count: int, message: str) -> None:
    spec = ShapeTaskSpec(layout=layout, canvas=canvas, min_count=count, max_count=count)
    with pytest.raises(ValueError, match=message):
        make_example(spec, seed=1, index=0)


def test_dataset_rows_carry_consistent_labels() -> None:
    task = TaskArguments(shapes_layout="single", shapes_canvas=140, shapes_max_count=3, shapes_train_size=6)
    train = get_dataset(task, "train", max_pixels=100 * 100)
    held_out = get_dataset(task, "eval", max_pixels=100 * 100)
    for row in train:
        assert row["answer"] == row["ground_truth"][row["shape"]]
        assert row["prompt"][0]["content"][1]["text"] == question_for(row["shape"])
        assert row["image"].mode == "RGB"
        assert row["image"].width * row["image"].height <= 100 * 100
    assert {row["id"] for row in train}.isdisjoint(row["id"] for row in held_out)


def _pixels(image) -> np.ndarray:
    return np.asarray(image).reshape(-1, 3)


def test_out_of_distribution_looks_change_only_what_they_name() -> None:
    """Colour and background keep every shape in place (the same layout), so each variant image pairs with its
    training-like twin; sizes outside the training range draw smaller shapes only."""
    seed_look = ShapeTaskSpec(layout="single", canvas=168)
    for index in range(12):
        plain = _pixels(make_example(seed_look, 2, index).image)
        shape_at = (plain != 255).any(axis=1)
        orange = _pixels(make_example(replace(seed_look, fill_color="orange"), 2, index).image)
        assert ((orange != 255).any(axis=1) == shape_at).all()
        assert {tuple(p) for p in orange[shape_at]} <= {(255, 165, 0), (140, 90, 0)}  # orange, its outline
        noisy = _pixels(make_example(replace(seed_look, background="noise"), 2, index).image)
        assert (noisy[shape_at] == plain[shape_at]).all() and (noisy[~shape_at] != 255).mean() > 0.5
        small = make_example(replace(seed_look, size_range=(5, 9)), 2, index)
        assert small.answer == make_example(seed_look, 2, index).answer  # the count is drawn first
        assert ((_pixels(small.image) != 255).any(axis=1)).sum() <= small.answer * (2 * 9 + 1) ** 2


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--shapes_fill_color", "blu"], r"shapes_fill_color: 'blu' is not a colour Pillow knows"),
        (["--shapes_background", "grass"], r"shapes_background: 'grass' is not one of \['white', 'noise'\]"),
        (["--shapes_size_range", "9", "5"], r"shapes_size_range: \[9, 5\] must be \[low, high\] with 1 <= low"),
        (["--shapes_size_range", "5"], r"shapes_size_range: \[5\] must be \[low, high\]"),
        (["--shapes_size_range", "5", "90"], r"half-width up to 90px do not fit: one is wider than .* 168px canvas"),
        (["--shapes_size_range", "5", "30"], r"up to 30px do not fit: 5 of them need more than half of a 168px"),
    ],
)
def test_a_variant_that_cannot_be_drawn_is_refused_naming_the_key(flags: list[str], said: str) -> None:
    argv = ["--config", "recipes/shapes/tiny_grpo_perception.yaml", *flags]
    with pytest.raises(RecipeError, match=said):
        parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)
