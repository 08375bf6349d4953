"""The GeoQA task (the GeoQA seed's): a geometry diagram, a Chinese multiple-choice question with four options, the
answer a boxed option letter. Training on every `train` row, evaluation on the seed's fixed 100-question test subset;
loading, validation and the prompt are in `data/geoqa.py`.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from vision_grpo.data import geoqa, prepared, prompts_and_images, reading, report_unused
from vision_grpo.data.prepared import ERROR
from vision_grpo.data.prompts_and_images import PROMPT_FEATURE, checked_prompt, normalize_image, normalized_size
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
        "label": datasets.Value("int64"),
        ERROR: datasets.Value("string"),
    }
)


def check(task_args: Any) -> None:
    languages = list(geoqa.PROMPT_TEMPLATES)
    if task_args.prompt_language not in languages:
        raise ValueError(f"prompt_language: {task_args.prompt_language!r} is not one of {languages}")


def _check(row: dict[str, Any], position: int, language: str, max_pixels: int, code: str) -> dict[str, Any]:
    """The checking pass over one raw row (`geoqa.check_row`, then the prompt and the size training sees the image at);
    the decoded image is dropped; `code` is in the cache key, not used."""
    out = {"id": str(row["id"]), "prompt": [], "label": row["label"] if isinstance(row["label"], int) else -1}
    try:
        image = geoqa.check_row(row)
        text = geoqa.format_question(row["subject"], row["choices"], language)
        size = normalized_size(image, max_pixels)
        out["prompt"] = checked_prompt(str(row["id"]), text, [size], "after_text")
    except ValueError as error:  # GeoQADataError (it names the row) and checked_prompt's RowRefused
        return {**out, ERROR: str(error) if "GeoQA row id=" in str(error) else f"GeoQA row id={row['id']!r}: {error}"}
    return {**out, ERROR: None}


def _decode(batch: dict[str, list], max_pixels: int) -> dict[str, list]:
    """The transform at access: each row's encoded image opened and normalised."""
    if "image" in batch:
        batch["image"] = [normalize_image(geoqa.open_image(value), max_pixels) for value in batch["image"]]
    return batch


def load(task_args: Any, split: str, max_pixels: int) -> datasets.Dataset:
    """GeoQA rows: the `train` rows for training, the fixed 100-question test subset for evaluation; checked once
    (cached, see data/prepared.py), images decoded when read."""
    rows = geoqa.load_split(
        task_args.dataset_name, task_args.dataset_revision, split, task_args.geoqa_test_rows or None
    )
    rows = rows.cast_column("image", datasets.Image(decode=False))
    deciding = {"language": task_args.prompt_language, "max_pixels": max_pixels}
    code = prepared.code_digest(geoqa, sys.modules[__name__], prompts_and_images)
    checked, bad = prepared.checked_rows(
        rows, _check, {**deciding, "code": code}, FEATURES, f"GeoQA {split}", keep={"image": "image"}
    )
    if bad and not task_args.skip_bad_rows:
        raise geoqa.GeoQADataError(bad[0][1])
    for _, reason in bad:
        logger.warning("skipping %s", reason)
    if bad:
        report_unused(split, "invalid, skipped (skip_bad_rows)", len(bad), [row_id for row_id, _ in bad])
        logger.warning("GeoQA %s: skipped %d invalid row(s) of %d", split, len(bad), len(rows))
    return reading.decode_on_access(checked, functools.partial(_decode, max_pixels=max_pixels))


def score(row: dict[str, Any], text: str) -> dict[str, Any]:
    """The seed's rule: the boxed option letter of the completion against the label."""
    prediction = parse_boxed_option(text)
    gold = OPTION_LETTERS[int(row["label"])]
    return {"gold": gold, "prediction": prediction, "correct": prediction == gold}


def identity(task_args: Any) -> dict[str, Any]:
    """The source and its pinned revision (None: whatever `main` was), the expected test split, the prompt; for a
    local copy also the content digest of its data files, so that data edited under the same path is noticed."""
    files = prepared.source_files(Path(task_args.dataset_name).expanduser())
    return {
        "source_sha256": prepared.files_digest(files) if files else None,
        "name": task_args.dataset_name,
        "revision": task_args.dataset_revision,
        "test_rows": task_args.geoqa_test_rows,
        "prompt_language": task_args.prompt_language,
    }
