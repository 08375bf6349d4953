"""Offline fixtures of our own making for the generic VQA task (nothing downloaded), each in the shape of a dataset
people bring, and each stored in another of the source forms `task: vqa` reads:

- `geometry3k/`: geometry3k-shaped: a right-triangle diagram (`images`, a list of one image), a `problem`, and a
  free-form `answer` such as `2\\sqrt{5}` (checked with `math_verify`); `train.parquet` and `test.parquet`.
- `clevr_count/`: CLEVR-counting-shaped: a scene of coloured objects (`image_filename`, a PNG in `images/`), "How
  many ... are there?", a numeric `answer`; `train.jsonl` and `test.jsonl`.
- `two_image/`: two images per row ("Which image has more circles?"), two options, the answer an index; a
  `save_to_disk` DatasetDict with `train` and `test`.

    python -m vision_grpo.data.vqa_fixtures --output .cache/vqa
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import datasets
import sympy
from PIL import Image, ImageDraw

SPLITS = {"train": 48, "test": 16}
COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "green": (40, 170, 60)}


def _triangle(a: int, b: int) -> Image.Image:
    """A right triangle with legs labelled a and b and the hypotenuse labelled x."""
    image = Image.new("RGB", (160, 120), "white")
    draw = ImageDraw.Draw(image)
    corner, top, right = (20, 100), (20, 100 - 10 * b), (20 + 12 * a, 100)
    draw.polygon([corner, top, right], outline="black", width=2)
    draw.rectangle([20, 92, 28, 100], outline="black")
    draw.text((4, 100 - 5 * b), str(b), fill="black")
    draw.text((20 + 6 * a, 104), str(a), fill="black")
    draw.text((24 + 6 * a, 96 - 5 * b), "x", fill="black")
    return image


def geometry3k_rows(split: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(f"geometry3k:{seed}:{split}")
    rows = []
    for index in range(count):
        a, b = rng.randint(1, 8), rng.randint(1, 8)
        answer = sympy.latex(sympy.sqrt(a * a + b * b))  # `5`, `2 \sqrt{5}`, `\sqrt{41}`, ...
        rows.append(
            {
                "id": f"{split}-{index}",
                "images": [_triangle(a, b)],
                "problem": f"The legs of the right triangle are {a} and {b}. Find x.",
                "answer": answer,
            }
        )
    return rows


def _scene(rng: random.Random, counts: dict[str, int]) -> Image.Image:
    image = Image.new("RGB", (128, 128), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    for colour, count in counts.items():
        for _ in range(count):
            x, y = rng.randint(8, 108), rng.randint(8, 108)
            draw.ellipse([x, y, x + 14, y + 14], fill=COLOURS[colour])
    return image


def write_clevr_count(folder: Path, seed: int) -> None:
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for split, count in SPLITS.items():
        rng = random.Random(f"clevr:{seed}:{split}")
        lines = []
        for index in range(count):
            counts = {colour: rng.randint(0, 3) for colour in COLOURS}
            asked = rng.choice([*COLOURS, None])
            filename = f"{split}_{index:04d}.png"
            _scene(rng, counts).save(folder / "images" / filename)
            question = f"How many {asked} objects are there?" if asked else "How many objects are there?"
            answer = counts[asked] if asked else sum(counts.values())
            lines.append({"id": f"{split}-{index}", "image_filename": filename, "question": question, "answer": answer})
        text = "".join(json.dumps(line) + "\n" for line in lines)
        (folder / f"{split}.jsonl").write_text(text, encoding="utf-8")


def _circles(rng: random.Random, count: int) -> Image.Image:
    return _scene(rng, {"blue": count})


def two_image_rows(split: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(f"two-image:{seed}:{split}")
    rows = []
    for index in range(count):
        first, second = rng.sample(range(1, 6), 2)
        rows.append(
            {
                "id": f"{split}-{index}",
                "images": [_circles(rng, first), _circles(rng, second)],
                "question": "Which image has more circles?",
                "options": ["the first image", "the second image"],
                "answer": 0 if first > second else 1,
            }
        )
    return rows


def write_fixtures(output: str | Path, seed: int = 0) -> Path:
    """Write the three fixtures under `output`; returns it."""
    output = Path(output)
    for split, count in SPLITS.items():
        geometry = datasets.Dataset.from_list(geometry3k_rows(split, count, seed))
        geometry.cast_column("images", datasets.Sequence(datasets.Image())).to_parquet(
            str(output / "geometry3k" / f"{split}.parquet")
        )
    write_clevr_count(output / "clevr_count", seed)
    two = {split: datasets.Dataset.from_list(two_image_rows(split, n, seed)) for split, n in SPLITS.items()}
    two = {split: d.cast_column("images", datasets.Sequence(datasets.Image())) for split, d in two.items()}
    datasets.DatasetDict(two).save_to_disk(str(output / "two_image"))
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vision_grpo.data.vqa_fixtures", description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=".cache/vqa", help="folder to write the three fixtures into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"wrote {write_fixtures(args.output, args.seed)}: geometry3k/, clevr_count/, two_image/")


if __name__ == "__main__":
    main()
