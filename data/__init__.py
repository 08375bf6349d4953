"""Datasets of the recipes: `get_rows(task_args, split, max_pixels)` returns rows ready for TRL and the evaluator,
and the rows of the source left out (`get_dataset`: the rows alone).

The rows come from the recipe's task (a module of this folder or of a recipe's `task_dirs`, see
vision_grpo/plugins/tasks.py): `task_shapes.py`, `task_geoqa.py`, `task_vqa.py` (any VQA dataset, configured in the
recipe). Every row has `id`, a conversational `prompt` with its image slot(s), the normalised `image` (or `images`; see
`prompts_and_images.py`, the multimodal collator), and the columns the task's rewards read. The checking pass runs once
per dataset (its rows cache, data/prepared.py); a row's images are decoded (shape images drawn) and normalised each
time the row is read (data/reading.py), so memory does not grow with the rows.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import datasets

from vision_grpo.plugins.tasks import task_of

logger = logging.getLogger(__name__)

SPLITS = ("train", "eval")
# What `report_unused` collects while `get_rows` runs a task's `load`, by split: counts and ids by reason.
_REPORTS: ContextVar[dict[str, tuple[dict[str, int], dict[str, list[str]]]] | None] = ContextVar(
    "unused rows", default=None
)


@dataclass(frozen=True)
class Rows:
    """A split's rows (`dataset`) and the rows of its source left out, by reason (skipped as invalid, another split,
    ...): their counts, which a run's manifest and an evaluation's result record, and the ids the task named."""

    dataset: datasets.Dataset
    unused: dict[str, int]
    unused_ids: dict[str, list[str]]


def report_unused(split: str, reason: str, count: int, ids: Sequence[str] = ()) -> None:
    """Called by a task's `load`: `count` rows of `split` not used, and why; `ids`, where the task names the rows
    (those it skipped), go into an evaluation's result beside the count. `get_rows` returns them; a `load` called
    on its own (a test, a benchmark) reports to no one."""
    reports = _REPORTS.get()
    if reports is None:
        return
    counts, named = reports.setdefault(split, ({}, {}))
    if count:
        counts[reason] = counts.get(reason, 0) + count
    if ids:
        named.setdefault(reason, []).extend(ids)


def _image_key(value: Any) -> tuple[str, ...]:
    """An encoded image cell (one image or a list) by content: its bytes' digest, or its path when it has no bytes."""
    cells = value if isinstance(value, list) else [value]
    return tuple(
        hashlib.blake2b(cell["bytes"], digest_size=16).hexdigest()
        if isinstance(cell, dict) and cell.get("bytes")
        else str(cell.get("path") if isinstance(cell, dict) else cell)
        for cell in cells
    )


def warn_split_overlap(
    train: datasets.Dataset, evaluation: datasets.Dataset, id_column: str | None, question: str, image: str, where: str
) -> tuple[int, int]:
    """Warn when evaluation rows share their id, or their question and image, with training rows: evaluation would
    score rows the model was trained on. Reads the raw columns (Arrow, nothing decoded) and hashes only the images of
    rows whose question text appears in both splits. Returns (shared ids, shared question-and-image pairs)."""
    train_raw, eval_raw = train.with_format("arrow"), evaluation.with_format("arrow")
    shared_ids: list[str] = []
    if id_column:
        train_ids = {str(value) for value in train_raw[id_column].to_pylist()}
        shared_ids = [str(value) for value in eval_raw[id_column].to_pylist() if str(value) in train_ids]
    by_question: dict[str, list[int]] = {}
    for index, text in enumerate(train_raw[question].to_pylist()):
        by_question.setdefault(str(text), []).append(index)
    eval_questions = [str(text) for text in eval_raw[question].to_pylist()]
    candidates = [index for index, text in enumerate(eval_questions) if text in by_question]
    train_images, eval_images = train_raw[image], eval_raw[image]
    train_keys: dict[str, set[tuple[str, ...]]] = {}  # per question, its training rows' images: each hashed once

    def keys_of(text: str) -> set[tuple[str, ...]]:
        if text not in train_keys:
            train_keys[text] = {_image_key(train_images[other].as_py()) for other in by_question[text]}
        return train_keys[text]

    eval_ids = eval_raw[id_column].to_pylist() if id_column else list(range(len(eval_questions)))
    shared_pairs = [
        str(eval_ids[index])
        for index in candidates
        if _image_key(eval_images[index].as_py()) in keys_of(eval_questions[index])
    ]
    for count, what, examples in (
        (len(shared_ids), "share their id with a training row", shared_ids),
        (len(shared_pairs), "share their question and image with a training row", shared_pairs),
    ):
        if count:
            logger.warning(
                "%s: %d of %d evaluation row(s) %s (e.g. ids %s): evaluation scores rows the model may have been "
                "trained on; remove them from one split",
                where,
                count,
                len(eval_questions),
                what,
                ", ".join(map(repr, examples[:5])),
            )
    return len(shared_ids), len(shared_pairs)


def get_rows(task_args: Any, split: str, max_pixels: int) -> Rows:
    """The rows of `split` (`train` or `eval`) of the recipe's task, and those of its source it left out; fails if
    nothing is left."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    reports: dict[str, tuple[dict[str, int], dict[str, list[str]]]] = {}
    token = _REPORTS.set(reports)
    try:
        dataset = task_of(task_args).load(task_args, split, max_pixels)
    finally:
        _REPORTS.reset(token)
    if len(dataset) == 0:
        raise ValueError(f"the {task_args.task} {split} dataset is empty after filtering")
    unused, unused_ids = reports.get(split, ({}, {}))
    return Rows(dataset, unused, unused_ids)


def get_dataset(task_args: Any, split: str, max_pixels: int) -> datasets.Dataset:
    """The rows of `split` of the recipe's task (`get_rows`, for a caller that records no unused rows)."""
    return get_rows(task_args, split, max_pixels).dataset


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
