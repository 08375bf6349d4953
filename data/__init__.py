"""Datasets of the recipes: `get_dataset(task_args, split, max_pixels)` returns rows ready for TRL and the evaluator.

The rows come from the recipe's task (a module of this folder or of a recipe's `task_dirs`, see
vision_grpo/plugins/tasks.py): `task_shapes.py`, `task_geoqa.py`, `task_vqa.py` (any VQA dataset, configured in the
recipe). Every row has `id`, a conversational `prompt` with its image slot(s), the normalised `image` (or `images`; see
`prompts_and_images.py`, the multimodal collator), and the columns the task's rewards read. Rows are built once per
dataset with `Dataset.map`, so no image is re-normalised at every training step.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from typing import Any

import datasets

from vision_grpo.plugins.tasks import task_of

logger = logging.getLogger(__name__)

SPLITS = ("train", "eval")
# Rows of the source that the last `get_dataset` of each split did not use, by reason: tasks report them with
# `report_unused`, the log names them, the run's manifest records the counts and an evaluation's result the ids too.
_UNUSED: dict[str, dict[str, int]] = {}
_UNUSED_IDS: dict[str, dict[str, list[str]]] = {}


def report_unused(split: str, reason: str, count: int, ids: Sequence[str] = ()) -> None:
    """Called by a task's `load`: `count` rows of `split` not used, and why (skipped as invalid, another split, ...);
    `ids`, where the task names the rows (those it skipped), go into an evaluation's result beside the count."""
    if count:
        _UNUSED.setdefault(split, {})[reason] = _UNUSED.get(split, {}).get(reason, 0) + count
    if ids:
        _UNUSED_IDS.setdefault(split, {}).setdefault(reason, []).extend(ids)


def unused_rows() -> dict[str, dict[str, int]]:
    """The counts `report_unused` collected for each split loaded in this process, for the run's manifest."""
    return {split: dict(reasons) for split, reasons in _UNUSED.items()}


def unused_row_ids(split: str) -> dict[str, list[str]]:
    """The ids `report_unused` was given for `split` in this process, by reason (an evaluation's result)."""
    return {reason: list(ids) for reason, ids in _UNUSED_IDS.get(split, {}).items()}


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


def get_dataset(task_args: Any, split: str, max_pixels: int) -> datasets.Dataset:
    """The rows of `split` (`train` or `eval`) of the recipe's task; fails if nothing is left."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    _UNUSED.pop(split, None)
    _UNUSED_IDS.pop(split, None)
    dataset = task_of(task_args).load(task_args, split, max_pixels)
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
