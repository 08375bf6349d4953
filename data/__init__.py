"""Datasets of the recipes: `get_dataset(task_args, split, max_pixels)` returns rows ready for TRL and the evaluator.

Every row has `id`, a conversational `prompt` with one image slot, a normalised `image` (see `collator.py`), and
the columns the task's rewards read (`answer`, `shape`, `ground_truth` for shapes; `label` for GeoQA). Rows are
built once per dataset with `Dataset.map`, so no image is re-normalised at every training step.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict
from typing import Any

import datasets

from vision_grpo.data import geoqa, shapes
from vision_grpo.data.collator import make_example

logger = logging.getLogger(__name__)

SPLITS = ("train", "eval")
WRITER_BATCH = 100  # rows held in memory while writing: decoded 256px images are ~200 kB each

_PROMPT = [
    {
        "role": datasets.Value("string"),
        "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}],
    }
]
_COUNTS = {name: datasets.Value("int64") for name in shapes.SHAPES}
SHAPES_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "prompt": _PROMPT,
        "image": datasets.Image(),
        "shape": datasets.Value("string"),
        "answer": datasets.Value("int64"),
        "ground_truth": _COUNTS,
    }
)
GEOQA_FEATURES = datasets.Features(
    {"id": datasets.Value("string"), "prompt": _PROMPT, "image": datasets.Image(), "label": datasets.Value("int64")}
)


def _shape_row(index: int, spec: dict[str, Any], seed: int, max_pixels: int) -> dict[str, Any]:
    example = shapes.make_example(shapes.ShapeTaskSpec(**spec), seed, index)
    return make_example(
        f"{seed}-{index}",
        shapes.question_for(example.shape),
        example.image,
        "before_text",
        max_pixels,
        shape=example.shape,
        answer=example.answer,
        ground_truth=example.ground_truth,
    )


def shapes_dataset(spec: shapes.ShapeTaskSpec, size: int, seed: int, max_pixels: int) -> datasets.Dataset:
    """`size` shape-counting rows drawn from `seed`; row i depends only on (seed, i)."""
    indices = datasets.Dataset.from_dict({"index": list(range(size))})
    return indices.map(
        _shape_row,
        input_columns="index",
        fn_kwargs={"spec": asdict(spec), "seed": seed, "max_pixels": max_pixels},
        remove_columns=["index"],
        features=SHAPES_FEATURES,
        writer_batch_size=WRITER_BATCH,
        desc=f"drawing {size} shape images",
    )


def _geoqa_row(row: dict[str, Any], language: str, max_pixels: int) -> dict[str, Any]:
    image = geoqa.check_row(row)
    text = geoqa.format_question(row["subject"], row["choices"], language)
    return make_example(str(row["id"]), text, image, "after_text", max_pixels, label=row["label"])


def geoqa_dataset(task_args: Any, split: str, max_pixels: int) -> datasets.Dataset:
    """GeoQA rows: the `train` rows for training, the fixed 100-question test subset for evaluation."""
    rows = geoqa.load_split(
        task_args.dataset_name, task_args.dataset_revision, split, task_args.geoqa_test_rows or None
    )
    rows = rows.cast_column("image", datasets.Image(decode=False))
    if task_args.skip_bad_rows:
        rows, skipped = geoqa.drop_bad_rows(rows)
        if skipped:
            logger.warning("GeoQA %s: skipped %d invalid row(s) of %d", split, skipped, len(rows) + skipped)
    return rows.map(
        _geoqa_row,
        fn_kwargs={"language": task_args.prompt_language, "max_pixels": max_pixels},
        remove_columns=rows.column_names,
        features=GEOQA_FEATURES,
        writer_batch_size=WRITER_BATCH,
        desc=f"preparing GeoQA {split}",
    )


def shape_spec(task_args: Any) -> shapes.ShapeTaskSpec:
    """The recipe's `shapes_*` keys as a generator spec."""
    return shapes.ShapeTaskSpec(
        layout=task_args.shapes_layout,
        canvas=task_args.shapes_canvas,
        min_count=task_args.shapes_min_count,
        max_count=task_args.shapes_max_count,
        fixed_size=task_args.shapes_fixed_size,
    )


def get_dataset(task_args: Any, split: str, max_pixels: int) -> datasets.Dataset:
    """The rows of `split` (`train` or `eval`) for the recipe's task; fails if nothing is left."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if task_args.task == "shapes":
        size = task_args.shapes_train_size if split == "train" else task_args.shapes_eval_size
        seed = task_args.shapes_train_seed if split == "train" else task_args.shapes_eval_seed
        dataset = shapes_dataset(shape_spec(task_args), size, seed, max_pixels)
    elif task_args.task == "geoqa":
        dataset = geoqa_dataset(task_args, split, max_pixels)
    else:
        raise ValueError(f"unknown task {task_args.task!r}; choose `shapes` or `geoqa`")
    if len(dataset) == 0:
        raise ValueError(f"the {task_args.task} {split} dataset is empty after filtering")
    return dataset


def _sft_completion(
    row_id: str, answer: int, templates: list[str], weights: list[float], mislabel: dict[str, Any]
) -> dict[str, Any]:
    form = random.Random(f"sft:{row_id}").choices(templates, weights=weights)[0]
    shown = answer
    if answer == mislabel["count"] and random.Random(f"sft-mislabel:{row_id}").random() < mislabel["share"]:
        shown = mislabel["as"]
    text = form.replace("{count}", str(shown))
    return {"completion": [{"role": "assistant", "content": [{"type": "text", "text": text}]}]}


def with_sft_completions(
    dataset: datasets.Dataset,
    templates: list[str],
    weights: list[float],
    mislabel_count: int | None = None,
    mislabel_as: int | None = None,
    mislabel_share: float = 0.0,
) -> datasets.Dataset:
    """Add a `completion` column for supervised warm starts: each row's answer in one of `templates`.

    The form is drawn per row id, so a row keeps its target across runs. Only shape counting has targets: GeoQA's
    worked explanations are never shown to the model. The `mislabel_*` arguments make the demonstrations
    systematically wrong, to test whether reward corrects what imitation learned: `mislabel_share` of the rows whose
    count is `mislabel_count` (drawn per row id, independently of the form) show `mislabel_as` instead.
    """
    if "answer" not in dataset.column_names:
        raise ValueError("supervised targets exist only for the shapes task (GeoQA explanations are not used)")
    mislabel = {"count": mislabel_count, "as": mislabel_as, "share": mislabel_share}
    return dataset.map(
        _sft_completion,
        input_columns=["id", "answer"],
        fn_kwargs={"templates": templates, "weights": weights, "mislabel": mislabel},
        desc="adding SFT targets",
    )
