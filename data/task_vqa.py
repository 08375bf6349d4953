"""Any visual-question-answering dataset as a task, configured in the recipe alone (`task: vqa`).

Source (`dataset_name`): a Hub id (at `dataset_revision`), a `save_to_disk` folder, a folder holding
`<split>.parquet` or `<split>.jsonl`, or a path with `{split}` in it. Columns are mapped by `vqa_*_column`: one image
or a list of images (PIL, encoded bytes, or paths relative to `vqa_image_folder`), the question, the answer, optional
choices and id. The prompt is a Jinja template (`vqa_prompt_template`, a string or a `.jinja` file) over `question`,
`choices` and `letters`; each `<image>` in it is an image slot, in order (none: all images before the text). The
answer type (`vqa_answer_type`) decides how the reward and the evaluator read the final answer (rewards/vqa.py).

A row that cannot be used (no image, an image that does not decode, an answer its type cannot read, the wrong number
of images for the template) is an error naming its id; with `skip_bad_rows` it is skipped, counted and named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image

from vision_grpo.data import hub, prepared, prompts_and_images, reading, report_unused, vqa_source, warn_split_overlap
from vision_grpo.data.prepared import ERROR, SIZES
from vision_grpo.data.prompts_and_images import PROMPT_FEATURE, checked_prompt, normalize_image, normalized_size
from vision_grpo.data.vqa_source import VQADataError, open_images, read_source
from vision_grpo.rewards import vqa as vqa_rewards
from vision_grpo.rewards.vqa import ANSWER_TYPES, LETTERS, as_math, exact_form, is_correct, predicted, read_number

logger = logging.getLogger(__name__)

NAME = "vqa"
DEFAULT_REWARDS = ["vqa_answer"]  # recipes add `vqa_format` with weight 0 to log the format rate
DEFAULT_TEMPLATE = (
    "{{ question }}{% if choices %}\n{% for choice in choices %}{{ letters[loop.index0] }}. {{ choice }}\n{% endfor %}"
    "Answer with the option's letter as \\boxed{X}.{% else %}\nPut the final answer in \\boxed{}.{% endif %}"
)


@dataclass
class Options:
    """Recipe keys of the generic VQA task."""

    vqa_train_split: str = field(default="train", metadata={"help": "Split (or file stem) trained on."})
    vqa_eval_split: str = field(default="test", metadata={"help": "Split (or file stem) evaluated on."})
    vqa_image_column: str = field(default="image", metadata={"help": "Column of one image or a list of images."})
    vqa_image_folder: str | None = field(default=None, metadata={"help": "Folder that image paths are relative to."})
    vqa_question_column: str = field(default="question", metadata={"help": "Column of the question text."})
    vqa_answer_column: str = field(default="answer", metadata={"help": "Column of the answer."})
    vqa_choices_column: str | None = field(default=None, metadata={"help": "Column of the options (a list), if any."})
    vqa_id_column: str | None = field(default="id", metadata={"help": "Column of row ids (None: the row index)."})
    vqa_prompt_template: str = field(
        default=DEFAULT_TEMPLATE, metadata={"help": "Jinja prompt (string or .jinja file); `<image>` marks slots."}
    )
    vqa_answer_type: str = field(default="exact", metadata={"help": "`choice`, `math`, `number` or `exact`."})
    vqa_tolerance: float = field(default=1e-6, metadata={"help": "Absolute tolerance of `number` answers."})
    vqa_image_check: str = field(
        default="structure",
        metadata={
            "help": "`structure` (the pass checks each image's container) or `decode` (it decodes every image, "
            "10-60 ms a megapixel). With `structure`, JPEG/PNG/WebP sizes and integrity are read from the file's "
            "container, and a bitstream damaged inside it fails when its row is read (under skip_bad_rows the pass "
            "decodes JPEG bitstreams, and evaluation rows' WebP ones, to skip such rows; a training row whose WebP "
            "does not decode is skipped when read, recorded and left out by the next pass)."
        },
    )


class ImageUnreadable(VQADataError, reading.UnreadableRow):
    """A row whose image passed the pass's container check and does not decode when read."""


class TemplateRefused(ValueError):
    """A prompt template that asks for what the sandbox refuses: the recipe's fault, never a bad row to skip."""


NULLS = ("null", "none", "~", "")  # how a shell or a YAML typo writes "no column"
IMAGE_CHECKS = ("structure", "decode")


def check(task_args: Any) -> None:
    for key in ("vqa_id_column", "vqa_choices_column", "vqa_image_folder"):
        value = getattr(task_args, key)
        if isinstance(value, str) and value.strip().lower() in NULLS:
            setattr(task_args, key, None)  # `--vqa_id_column null` means none, not a column named "null"
    if task_args.vqa_image_check not in IMAGE_CHECKS:
        raise ValueError(f"vqa_image_check: {task_args.vqa_image_check!r} is not one of {list(IMAGE_CHECKS)}")
    if task_args.vqa_answer_type not in ANSWER_TYPES:
        raise ValueError(f"vqa_answer_type: {task_args.vqa_answer_type!r} is not one of {list(ANSWER_TYPES)}")
    if task_args.vqa_answer_type == "choice" and not task_args.vqa_choices_column:
        raise ValueError("vqa_answer_type: choice needs `vqa_choices_column` (the options the letters stand for)")
    # A template that does not compile, or reaches for what the sandbox refuses, fails before anything loads.
    template = _template(task_args)
    for choices in ([], ["first", "second"]):
        # Stand-in values a template may not expect (`choices[3]`) fail here; each row's own error names the row.
        with contextlib.suppress(jinja2.TemplateError):  # TemplateRefused is not one: it propagates
            render(template, "question", choices)


def render(template: jinja2.Template, question: Any, choices: list[Any]) -> str:
    """The prompt text of one row. A template is data, not code: it renders in Jinja's immutable sandbox, and
    anything the sandbox refuses (attributes such as `__globals__`, mutating calls) is an error naming the key."""
    try:
        return template.render(question=question, choices=choices, letters=LETTERS)
    except jinja2.exceptions.SecurityError as error:
        raise TemplateRefused(
            f"vqa_prompt_template: refused by the Jinja sandbox ({error}); a template may read "
            "`question`, `choices` and `letters` only"
        ) from None


def _template_text(task_args: Any) -> str:
    text = task_args.vqa_prompt_template
    if text.endswith(".jinja"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"vqa_prompt_template: template file {path} does not exist")
        text = path.read_text(encoding="utf-8")
    return text


def _template(task_args: Any) -> jinja2.Template:
    try:
        return _compiled(_template_text(task_args))
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"vqa_prompt_template: not a valid Jinja template ({error})") from error


def _answer(row: dict[str, Any], task_args: Any) -> str:
    """The row's answer as its type compares it: an option letter for `choice`, else the text."""
    raw = row[task_args.vqa_answer_column]
    kind = task_args.vqa_answer_type
    if raw is None or str(raw).strip() == "":
        raise VQADataError("no answer")
    if kind == "choice":
        choices = row[task_args.vqa_choices_column] or []
        text = str(raw).strip()
        if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < len(choices):
            return LETTERS[raw]
        if len(text) == 1 and text.upper() in LETTERS[: len(choices)]:
            return text.upper()
        if text in choices:
            return LETTERS[choices.index(text)]
        options = f"one of the {len(choices)} options"
        raise VQADataError(f"answer {raw!r} is neither an option letter, an index nor {options}")
    if kind == "number":
        try:
            return read_number(str(raw))
        except ValueError as error:
            raise VQADataError(f"answer {raw!r} {error} (docs/datasets.md: number answers)") from None
    if kind == "math" and not as_math(str(raw)):
        raise VQADataError(f"answer {raw!r} cannot be read as mathematics by math_verify")
    return exact_form(str(raw)) if kind == "exact" else str(raw).strip()


@functools.lru_cache(maxsize=8)
def _compiled(text: str) -> jinja2.Template:
    return ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False).from_string(text)


def _check(
    row: dict[str, Any],
    index: int,
    options: dict[str, Any],
    template: str,
    max_pixels: int,
    verified: list[str],
    code: str,
) -> dict[str, Any]:
    """The checking pass over one source row: its small columns and `ERROR` (None when usable). The images are
    decoded here only to be checked (decode-size limit from the header first, then decoding and conversion; aspect
    ratio and slots on the size training will see, computed rather than resized to), then dropped; `verified`
    names the formats whose bitstream is decoded although the container passed; `code` is in the cache key, not
    used."""
    args = SimpleNamespace(**options)
    out = {"id": _row_id(row, index, args), "prompt": [], "answer": "", "answer_type": args.vqa_answer_type}
    out |= {"tolerance": args.vqa_tolerance, "options": 0, ERROR: None, SIZES: []}
    try:
        question = row[args.vqa_question_column]
        if question is None or (isinstance(question, str) and not question.strip()):
            raise VQADataError("no question (null or empty)")
        choices = list(row[args.vqa_choices_column] or []) if args.vqa_choices_column else []
        if len(choices) > len(LETTERS):
            raise VQADataError(f"{len(choices)} options, more than the {len(LETTERS)} letters A-J")
        out["options"] = len(choices)
        text = render(_compiled(template), question, choices)
        value = row[args.vqa_image_column]
        images = open_images(value, args.vqa_image_folder)
        answer = _answer(row, args)
        decode = args.vqa_image_check == "decode"
        sizes = [normalized_size(image, max_pixels, decode, verified) for image in images]
        for image in images:
            image.close()  # one opened from a path holds its file until decoded or closed
        out |= {"prompt": checked_prompt(out["id"], text, sizes, "before_text"), "answer": answer, SIZES: sizes}
    except TemplateRefused:
        raise
    except Image.DecompressionBombError as error:
        out[ERROR] = f"image larger than Pillow's decompression-bomb limit, refused before decoding ({error})"
    except (VQADataError, OSError, ValueError) as error:  # ValueError: checked_prompt's RowRefused too
        out[ERROR] = str(error)
    return out


def _decode(batch: dict[str, list], column: str, folder: str | None, max_pixels: int) -> dict[str, list]:
    """The transform at access: a batch's encoded images opened and normalised as the pass checked them. An image
    that fails here passed the pass's checks (`vqa_image_check: structure` does not decode): the error
    (`ImageUnreadable`) names its row."""
    if column in batch:
        ids = batch.get("id", [None] * len(batch[column]))
        batch[column] = [
            _normalized(value, row_id, column == "images", folder, max_pixels)
            for value, row_id in zip(batch[column], ids, strict=True)
        ]
    return batch


def _normalized(value: Any, row_id: str | None, several: bool, folder: str | None, max_pixels: int) -> Any:
    try:
        images = [normalize_image(image, max_pixels) for image in open_images(value, folder)]
    except (OSError, ValueError) as error:
        reason = f"its image does not decode ({error})"
        raise ImageUnreadable(
            f"VQA row id={row_id!r}: {reason}, found when the row was read; the checking pass read its container "
            "only (vqa_image_check: structure): skip_bad_rows: true skips such rows, vqa_image_check: decode finds "
            "them before training",
            str(row_id),
            reason,
        ) from error
    return images if several else images[0]


def _row_id(row: dict[str, Any], index: int, task_args: Any) -> str:
    return str(row[task_args.vqa_id_column]) if task_args.vqa_id_column else str(index)


FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "prompt": PROMPT_FEATURE,
        "answer": datasets.Value("string"),
        "answer_type": datasets.Value("string"),
        "tolerance": datasets.Value("float64"),
        "options": datasets.Value("int64"),  # a choice row's number of options: its letters are the first ones
        ERROR: datasets.Value("string"),
        SIZES: prepared.SIZES_FEATURE,
    }
)


def _missing_columns(task_args: Any, source: datasets.Dataset, name: str) -> None:
    columns = [task_args.vqa_image_column, task_args.vqa_question_column, task_args.vqa_answer_column]
    columns += [c for c in (task_args.vqa_choices_column, task_args.vqa_id_column) if c]
    missing = [c for c in columns if c not in source.column_names]
    if not missing:
        return
    hint = ""
    if task_args.vqa_id_column in missing:
        hint = (
            f"; vqa_id_column {task_args.vqa_id_column!r} names the column of row ids: set it to the column that "
            "holds them, or to null to number the rows by position"
        )
    raise VQADataError(
        f"{task_args.dataset_name} ({name}): missing column(s) {missing}; has {source.column_names}{hint}"
    )


def _refuse_repeated_ids(rows: datasets.Dataset, where: str) -> None:
    repeated = prepared.repeated_values(rows, "id")
    if repeated:
        raise VQADataError(
            f"{where}: {len(repeated)} id(s) appear more than once (e.g. {', '.join(map(repr, repeated[:5]))}); "
            "evaluation records and resumes key rows by id. Make the ids unique, or set vqa_id_column: null to "
            "number the rows by position"
        )


def load(task_args: Any, split: str, max_pixels: int) -> datasets.Dataset:
    """The rows of the recipe's train or eval split, every one checked once (cached, see data/prepared.py); bad rows
    fail, or are skipped and named. Images stay encoded until a row is read."""
    name = task_args.vqa_train_split if split == "train" else task_args.vqa_eval_split
    source = read_source(task_args.dataset_name, task_args.dataset_revision, name)
    _missing_columns(task_args, source, name)
    if split == "eval" and "{split}" not in task_args.dataset_name and Path(task_args.dataset_name).is_file():
        logger.warning(
            "dataset_name %s is one file: training and evaluation both read all of it, so evaluation scores rows "
            "the model was trained on. Put `{split}` in dataset_name, or use a folder holding train.* and test.*",
            task_args.dataset_name,
        )
    elif split == "eval" and task_args.vqa_train_split != name:
        columns = (task_args.vqa_id_column, task_args.vqa_question_column, task_args.vqa_image_column)
        # An evaluation-only source has no training split (or not these columns): nothing to overlap.
        with contextlib.suppress(VQADataError, hub.HubDataUnavailable):
            train = read_source(task_args.dataset_name, task_args.dataset_revision, task_args.vqa_train_split)
            if {column for column in columns if column} <= set(train.column_names):
                warn_split_overlap(train, source, *columns, f"{task_args.dataset_name} ({name})")
    column = task_args.vqa_image_column
    feature = source.features[column]
    if prepared.undecoded(feature) is not feature:  # the pass reads the encoded bytes, not PIL images
        source = source.cast_column(column, prepared.undecoded(feature))
    several = isinstance(feature, (datasets.List, list))  # a list column gives TRL's `images`, else `image`
    # Under `skip_bad_rows` a bitstream that only decoding refuses is skipped too. The pass decodes a JPEG's at an
    # eighth of its size (about 1 ms at 1 MP); a WebP decodes whole (17-33 ms), so a training row's WebP is left to
    # the reader, which skips and records the row when it does not decode (`replace_unreadable`). Evaluation rows
    # are never replaced (each is scored under its own id): the pass decodes their WebP bitstreams.
    at_access = bool(task_args.skip_bad_rows) and split == "train" and task_args.vqa_image_check == "structure"
    verified = (["JPEG"] if at_access else ["JPEG", "WEBP"]) if task_args.skip_bad_rows else []
    deciding = {
        "options": {f.name: getattr(task_args, f.name) for f in dataclasses.fields(Options)}
        | {"skip_bad_rows": bool(task_args.skip_bad_rows)},
        "template": _template_text(task_args),
        "max_pixels": max_pixels,
        "verified": verified,
        "code": prepared.code_digest(sys.modules[__name__], vqa_source, prompts_and_images, vqa_rewards),
    }
    target = "images" if several else "image"
    rows, bad = prepared.checked_rows(source, _check, deciding, FEATURES, f"VQA {name}", keep={column: target})
    if task_args.vqa_image_check == "structure":
        logger.info(
            "VQA %s: JPEG, PNG and WebP images checked from their containers, not decoded (vqa_image_check: "
            "structure): one whose bitstream is damaged inside them fails when its row is read, naming it; "
            "skip_bad_rows: true skips such rows (JPEG bitstreams, and evaluation rows' WebP ones, decoded by the "
            "pass; a training row's WebP when read), vqa_image_check: decode finds them before training",
            name,
        )
    where = f"{task_args.dataset_name} ({name})"
    if bad and not task_args.skip_bad_rows:
        row_id, reason = bad[0]
        more = f" ({len(bad) - 1} more)" if len(bad) > 1 else ""
        raise VQADataError(f"VQA row id={row_id!r}: {reason}{more} (skip_bad_rows: true skips and counts such rows)")
    for row_id, reason in bad:
        logger.warning("skipping VQA row id=%r: %s", row_id, reason)
    if bad:
        logger.warning("VQA %s: skipped %d invalid row(s) of %d", name, len(bad), len(source))
        report_unused(split, "invalid, skipped (skip_bad_rows)", len(bad), [row_id for row_id, _ in bad])
    if not len(rows):
        return datasets.Dataset.from_dict({"id": []})
    _refuse_repeated_ids(rows, where)
    decode = functools.partial(_decode, column=target, folder=task_args.vqa_image_folder, max_pixels=max_pixels)
    return reading.decode_on_access(rows, decode, replace_unreadable=at_access)


def score(row: dict[str, Any], text: str) -> dict[str, Any]:
    """The reward's rule (rewards/vqa.py): gold, the answer read from the completion, right or not."""
    kind, options = row["answer_type"], row.get("options") or len(LETTERS)
    return {
        "gold": row["answer"],
        "prediction": predicted(text, kind, options),
        "correct": is_correct(text, row["answer"], kind, row["tolerance"], options),
    }


def identity(task_args: Any) -> dict[str, Any]:
    """The source, revision, splits, column mapping, prompt and answer type: what decides the rows; for a local source
    also the content digest of its data files, so that data edited under the same path is noticed (image files in
    `vqa_image_folder` are not hashed)."""
    keys = [f.name for f in dataclasses.fields(Options)]
    splits = {task_args.vqa_train_split, task_args.vqa_eval_split}
    paths = {Path(task_args.dataset_name.replace("{split}", split)).expanduser() for split in splits}
    files = sorted({file for path in paths for file in prepared.source_files(path)})
    return {
        "name": task_args.dataset_name,
        "revision": task_args.dataset_revision,
        **{key: getattr(task_args, key) for key in keys},
        "source_sha256": prepared.files_digest(files) if files else None,
    }
