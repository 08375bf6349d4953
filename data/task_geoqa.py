"""The GeoQA task (the GeoQA seed's): a geometry diagram, a Chinese multiple-choice question with four options, the
answer a boxed option letter. Training on every `train` row, evaluation on the seed's fixed 100-question test subset;
loading, validation and the prompt are in `data/geoqa.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import datasets

from vision_grpo.data import geoqa, report_unused
from vision_grpo.data.prompts_and_images import PROMPT_FEATURE, WRITER_BATCH, make_example
from vision_grpo.rewards.boxed_option import OPTION_LETTERS, parse_boxed_option

logger = logging.getLogger(__name__)

NAME = "geoqa"
DEFAULT_REWARDS = ["boxed_option"]  # the seed's reward; recipes add `boxed_option_format` with weight 0


@dataclass
class Options:
    """Recipe keys of the GeoQA task (`dataset_name` and `dataset_revision` name the source)."""

    geoqa_test_rows: int = field(default=759, metadata={"help": "Expected test rows; 0 accepts any revision."})
    prompt_language: str = field(default="zh", metadata={"help": "GeoQA prompt template: `zh` (seed) or `en`."})


FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "prompt": PROMPT_FEATURE,
        "image": datasets.Image(),
        "label": datasets.Value("int64"),
    }
)


def check(task_args: Any) -> None:
    languages = list(geoqa.PROMPT_TEMPLATES)
    if task_args.prompt_language not in languages:
        raise ValueError(f"prompt_language: {task_args.prompt_language!r} is not one of {languages}")


def _row(row: dict[str, Any], language: str, max_pixels: int) -> dict[str, Any]:
    image = geoqa.check_row(row)
    text = geoqa.format_question(row["subject"], row["choices"], language)
    return make_example(str(row["id"]), text, image, "after_text", max_pixels, label=row["label"])


def load(task_args: Any, split: str, max_pixels: int) -> datasets.Dataset:
    """GeoQA rows: the `train` rows for training, the fixed 100-question test subset for evaluation."""
    rows = geoqa.load_split(
        task_args.dataset_name, task_args.dataset_revision, split, task_args.geoqa_test_rows or None
    )
    rows = rows.cast_column("image", datasets.Image(decode=False))
    if task_args.skip_bad_rows:
        rows, skipped = geoqa.drop_bad_rows(rows)
        report_unused(split, "invalid, skipped (skip_bad_rows)", skipped)
        if skipped:
            logger.warning("GeoQA %s: skipped %d invalid row(s) of %d", split, skipped, len(rows) + skipped)
    return rows.map(
        _row,
        fn_kwargs={"language": task_args.prompt_language, "max_pixels": max_pixels},
        remove_columns=rows.column_names,
        features=FEATURES,
        writer_batch_size=WRITER_BATCH,
        desc=f"preparing GeoQA {split}",
    )


def score(row: dict[str, Any], text: str) -> dict[str, Any]:
    """The seed's rule: the boxed option letter of the completion against the label."""
    prediction = parse_boxed_option(text)
    gold = OPTION_LETTERS[int(row["label"])]
    return {"gold": gold, "prediction": prediction, "correct": prediction == gold}


def identity(task_args: Any) -> dict[str, Any]:
    """The source and its pinned revision (None: whatever `main` was), the expected test split, the prompt."""
    return {
        "name": task_args.dataset_name,
        "revision": task_args.dataset_revision,
        "test_rows": task_args.geoqa_test_rows,
        "prompt_language": task_args.prompt_language,
    }
