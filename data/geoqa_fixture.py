"""A GeoQA-schema fixture: generated rows with exactly the columns and types of `hz2475/geoQA`.

Offline tests and the CPU smoke recipe (`recipes/geoqa/tiny_cpu.yaml`) need GeoQA-shaped data without the Hub, and
no binary file is committed: this module draws it. Chinese questions from a few geometry templates, four options
with the correct one at `label`, diagrams drawn with PIL (lines, circles, point letters), some of them PNGs with a
transparent background (RGBA, as in the real data), 759 `test` rows so the fixed-subset logic runs on the real
size, and the `train`/`val` rows interleaved with them so that "dataset order" is tested, not assumed.

    python -m vision_grpo.data.geoqa_fixture --output .cache/geoqa_fixture.parquet
"""

from __future__ import annotations

import argparse
import io
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
from PIL import Image, ImageDraw

from vision_grpo.data.geoqa import TEST_ROWS

FEATURES = datasets.Features(
    {
        "id": datasets.Value("int64"),
        "subject": datasets.Value("string"),
        "choices": datasets.List(datasets.Value("string")),
        "label": datasets.Value("int64"),
        "formal_point": datasets.List(datasets.Value("string")),
        "answer": datasets.Value("string"),
        "comment": datasets.Value("string"),
        "original_split": datasets.Value("string"),
        "image": datasets.Image(),
    }
)
RGBA_SHARE = 0.25  # share of diagrams saved with a transparent background
Problem = tuple[str, str, list[str], list[str], str]  # question, correct option, distractors, points, explanation


def _isosceles(rng: random.Random) -> Problem:
    apex = rng.randrange(20, 140, 2)
    base = (180 - apex) // 2
    distractors = [f"{v}°" for v in (apex, 180 - apex, base + 10)]
    explanation = f"∵AB=AC，∴∠B=∠C=(180°-{apex}°)÷2={base}°。"
    return (
        f"如图，在△ABC中，AB=AC，∠A={apex}°，则∠B的度数为（）",
        f"{base}°",
        distractors,
        ["等腰三角形的性质", "三角形内角和定理"],
        explanation,
    )


def _inscribed(rng: random.Random) -> Problem:
    angle = rng.randrange(15, 75)
    distractors = [f"{v}°" for v in (angle, 180 - angle, 2 * angle)]
    return (
        f"如图，AB是⊙O的直径，点C在⊙O上，若∠ABC={angle}°，则∠BAC的度数为（）",
        f"{90 - angle}°",
        distractors,
        ["圆周角定理"],
        f"∵AB是直径，∴∠ACB=90°，∴∠BAC=90°-{angle}°={90 - angle}°。",
    )


def _parallel(rng: random.Random) -> Problem:
    angle = rng.randrange(30, 85)
    distractors = [f"{v}°" for v in (angle, 90 - angle, 90 + angle)]
    return (
        f"如图，直线a∥b，直线c与a、b相交，∠1={angle}°，则∠2的度数为（）",
        f"{180 - angle}°",
        distractors,
        ["平行线的性质", "邻补角"],
        f"∵a∥b，∴∠2=180°-∠1=180°-{angle}°={180 - angle}°。",
    )


def _right_triangle(rng: random.Random) -> Problem:
    scale = rng.randint(1, 3)
    a, b, c = (scale * n for n in rng.choice([(3, 4, 5), (5, 12, 13), (8, 15, 17)]))
    distractors = [str(v) for v in (a + b, c + 1, abs(b - a) + c)]
    return (
        f"如图，在Rt△ABC中，∠C=90°，AC={a}，BC={b}，则AB的长为（）",
        str(c),
        distractors,
        ["勾股定理"],
        f"AB=√({a}²+{b}²)={c}。",
    )


def _draw_triangle(draw: ImageDraw.ImageDraw, size: int, rng: random.Random) -> None:
    points = {"A": (size // 2, 12), "B": (12, size - 16), "C": (size - 14, size - 16)}
    draw.polygon(list(points.values()), outline=(0, 0, 0, 255), width=2)
    for name, (x, y) in points.items():
        draw.text((x - 10 if x < size // 2 else x + 2, y - 12 if y < size // 2 else y + 2), name, fill=(0, 0, 0, 255))


def _draw_circle(draw: ImageDraw.ImageDraw, size: int, rng: random.Random) -> None:
    centre, radius = size / 2, size / 2 - 14
    draw.ellipse([centre - radius, centre - radius, centre + radius, centre + radius], outline=(0, 0, 0, 255), width=2)
    theta = rng.uniform(0.3, 2.8)
    a, b = (centre - radius, centre), (centre + radius, centre)
    c = (centre + radius * math.cos(theta), centre - radius * math.sin(theta))
    draw.line([a, b, c, a], fill=(0, 0, 0, 255), width=2)
    for name, (x, y) in {"A": a, "B": b, "C": c, "O": (centre, centre)}.items():
        draw.text((x + 2, y + 2), name, fill=(0, 0, 0, 255))


def _draw_parallel(draw: ImageDraw.ImageDraw, size: int, rng: random.Random) -> None:
    for y, name in ((size // 3, "a"), (2 * size // 3, "b")):
        draw.line([(8, y), (size - 8, y)], fill=(0, 0, 0, 255), width=2)
        draw.text((size - 14, y - 14), name, fill=(0, 0, 0, 255))
    shift = rng.randint(-size // 4, size // 4)
    draw.line([(size // 2 - shift, 6), (size // 2 + shift, size - 6)], fill=(0, 0, 0, 255), width=2)
    draw.text((size // 2 + 4, size // 3 - 14), "1", fill=(0, 0, 0, 255))
    draw.text((size // 2 + 4, 2 * size // 3 + 2), "2", fill=(0, 0, 0, 255))


TEMPLATES: list[tuple[Callable[[random.Random], Problem], Callable[..., None]]] = [
    (_isosceles, _draw_triangle),
    (_inscribed, _draw_circle),
    (_parallel, _draw_parallel),
    (_right_triangle, _draw_triangle),
]


def _diagram(draw_fn: Callable[..., None], rng: random.Random) -> bytes:
    size = rng.randrange(128, 201)
    transparent = rng.random() < RGBA_SHARE
    image = Image.new("RGBA", (size, size), (255, 255, 255, 0 if transparent else 255))
    draw_fn(ImageDraw.Draw(image), size, rng)
    buffer = io.BytesIO()
    (image if transparent else image.convert("RGB")).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(row_id: int, split: str, rng: random.Random) -> dict[str, Any]:
    make_problem, draw_fn = rng.choice(TEMPLATES)
    question, correct, distractors, points, explanation = make_problem(rng)
    options = [correct, *dict.fromkeys(d for d in distractors if d != correct)]
    options += [f"{correct}（{k}）" for k in range(4 - len(options))]  # rare duplicates among distractors
    rng.shuffle(options)
    padding = rng.choice(["", " ", "\n", "  \n"])  # the prompt strips white space around the question
    return {
        "id": row_id,
        "subject": padding + question + padding,
        "choices": options[:4],
        "label": options.index(correct),
        "formal_point": points,
        "answer": explanation,
        "comment": "",
        "original_split": split,
        "image": {"bytes": _diagram(draw_fn, rng), "path": None},
    }


def fixture_rows(train_rows: int = 300, test_rows: int = TEST_ROWS, val_rows: int = 40, seed: int = 0) -> list[dict]:
    """The fixture's rows: splits interleaved in a seeded order, unique ids that are not row positions."""
    rng = random.Random(seed)
    splits = ["train"] * train_rows + ["test"] * test_rows + ["val"] * val_rows
    rng.shuffle(splits)
    ids = rng.sample(range(1, 10 * len(splits) + 1), len(splits))
    return [_row(row_id, split, rng) for row_id, split in zip(ids, splits, strict=True)]


def write_fixture(output: str | Path, **sizes: int) -> Path:
    """Write the fixture as one parquet file with the Hub dataset's features (`sizes`: see `fixture_rows`)."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    dataset = datasets.Dataset.from_list(fixture_rows(**sizes), features=FEATURES)
    dataset.to_parquet(str(output))
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vision_grpo.data.geoqa_fixture", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--output", type=Path, required=True, help="parquet file to write")
    parser.add_argument("--train-rows", type=int, default=300)
    parser.add_argument("--test-rows", type=int, default=TEST_ROWS)
    parser.add_argument("--val-rows", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_fixture(
        args.output, train_rows=args.train_rows, test_rows=args.test_rows, val_rows=args.val_rows, seed=args.seed
    )
    print(f"{path}: {args.train_rows} train, {args.test_rows} test, {args.val_rows} val rows")


if __name__ == "__main__":
    main()
