"""Data pipeline throughput: shape generator, image normalisation, dataset preparation, and row reads.

    python benchmarks/data_pipeline.py [--images 256] [--quick]

Stages, each timed on its own over the same images (images/s, median of `--repeats`):
- generator: `data/shapes.py` drawing an example (seed layout 256 px; the demo's single-shape 140 px);
- normalisation: `data/prompts_and_images.normalize_image` to the tiny model's pixel limit (a 256 px shape image, and a
  1024 px photo-sized image);
- Arrow storage: `datasets.Image` encoding (PNG, once per row at preparation) and decoding (every read);
- preparation: `get_dataset`, i.e. all of the above through `Dataset.map`, in rows/s;
- row reads: `dataset[i]` as the trainer's data loader does for each prompt of each step.
The preparation estimate for the tiny recipe and the demo recipe is rows / rows-per-second.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import datasets
import yaml
from common import RECIPE, REPO, machine, markdown_table, median, report
from PIL import Image

from vision_grpo.data import get_dataset, shapes
from vision_grpo.data.prompts_and_images import normalize_image
from vision_grpo.data.task_shapes import spec as shape_spec
from vision_grpo.models.replicas.families import FAMILIES, pixel_limits
from vision_grpo.recipe.arguments import TaskArguments

_, MAX_PIXELS = pixel_limits(FAMILIES["qwen2.5-vl"])  # the tiny Qwen2.5-VL replica's processor limit
DEMO_RECIPE = REPO / "recipes" / "shapes" / "tiny_grpo_demo.yaml"


def rate(count: int, call: Callable[[], Any], repeats: int) -> float:
    """Items per second of `call` (which handles `count` items), median over `repeats` timings."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return count / median(seconds)


def task_of(recipe: Path) -> TaskArguments:
    """The recipe's task keys (shapes_*, pixel limits) as TaskArguments."""
    keys = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    return TaskArguments(**{k: v for k, v in keys.items() if k in TaskArguments.__dataclass_fields__})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256, help="images per timing")
    parser.add_argument("--repeats", type=int, default=3, help="timings per stage (median)")
    parser.add_argument("--quick", action="store_true", help="smallest setting: 16 images, one timing")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.quick:
        args.images, args.repeats = 16, 1
    n, repeats = args.images, args.repeats
    datasets.disable_progress_bars()

    tiny, demo = task_of(RECIPE), task_of(DEMO_RECIPE)
    seed_spec, demo_spec = shape_spec(tiny), shape_spec(demo)
    drawn = [shapes.make_example(seed_spec, 0, i).image for i in range(n)]
    photo = Image.new("RGB", (1024, 768), "white")
    image_feature = datasets.Image()
    encoded = [image_feature.encode_example(normalize_image(image, MAX_PIXELS)) for image in drawn]

    stages: dict[str, float] = {
        "generator, seed layout 256 px": rate(
            n, lambda: [shapes.make_example(seed_spec, 0, i) for i in range(n)], repeats
        ),
        "generator, demo layout 140 px": rate(
            n, lambda: [shapes.make_example(demo_spec, 0, i) for i in range(n)], repeats
        ),
        "normalise 256 px shape image": rate(
            n, lambda: [normalize_image(image, MAX_PIXELS) for image in drawn], repeats
        ),
        "normalise 1024x768 image": rate(n, lambda: [normalize_image(photo, MAX_PIXELS) for _ in range(n)], repeats),
        "PNG encode (preparation)": rate(
            n, lambda: [image_feature.encode_example(normalize_image(i, MAX_PIXELS)) for i in drawn], repeats
        ),
        "PNG decode (every read)": rate(n, lambda: [image_feature.decode_example(e).load() for e in encoded], repeats),
    }
    prepared = {}
    for name, task in (("tiny recipe", tiny), ("demo recipe", demo)):
        sized = replace(task, shapes_train_size=n)
        stages[f"get_dataset, {name} rows"] = rate(n, lambda t=sized: get_dataset(t, "train", MAX_PIXELS), repeats)
        prepared[name] = (task.shapes_train_size, task.shapes_train_size / stages[f"get_dataset, {name} rows"])
    dataset = get_dataset(replace(tiny, shapes_train_size=n), "train", MAX_PIXELS)
    stages["row reads dataset[i]"] = rate(n, lambda: [dataset[i] for i in range(n)], repeats)

    print(f"\nData pipeline, {n} images per timing, median of {repeats} ({machine()})")
    print(markdown_table(["stage", "images/s"], [[name, value] for name, value in stages.items()]))
    for name, (rows, seconds) in prepared.items():
        print(f"preparing the {name}'s {rows} training rows: about {seconds:.2f} s (once per run)")
    figures = {"images_per_s": stages, "preparation_s": {k: v[1] for k, v in prepared.items()}, "machine": machine()}
    report("data_pipeline", figures, args.json)


if __name__ == "__main__":
    main()
