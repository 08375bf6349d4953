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
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image

from vision_grpo.data import report_unused
from vision_grpo.data.prompts_and_images import PROMPT_FEATURE, WRITER_BATCH, make_example
from vision_grpo.rewards.vqa import ANSWER_TYPES, as_math, is_correct, predicted

logger = logging.getLogger(__name__)

NAME = "vqa"
DEFAULT_REWARDS = ["vqa_answer"]  # recipes add `vqa_format` with weight 0 to log the format rate
LETTERS = "ABCDEFGHIJ"
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


class VQADataError(ValueError):
    """A VQA source or row that cannot be used as configured."""


class TemplateRefused(ValueError):
    """A prompt template that asks for what the sandbox refuses: the recipe's fault, never a bad row to skip."""


def check(task_args: Any) -> None:
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


def _template(task_args: Any) -> jinja2.Template:
    text = task_args.vqa_prompt_template
    if text.endswith(".jinja"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"vqa_prompt_template: template file {path} does not exist")
        text = path.read_text(encoding="utf-8")
    try:
        return ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False).from_string(text)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"vqa_prompt_template: not a valid Jinja template ({error})") from error


def _read(source: str, revision: str | None, split: str) -> datasets.Dataset:
    """The rows of `split` of `source` (see the module's docstring for the forms a source takes)."""
    path = Path(source.replace("{split}", split)).expanduser()
    if "{split}" in source or path.is_file():
        return _read_file(path)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            loaded = datasets.load_from_disk(str(path))
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        for suffix in (".parquet", ".jsonl"):
            if (path / f"{split}{suffix}").is_file():
                return _read_file(path / f"{split}{suffix}")
        raise VQADataError(f"{source}: no {split}.parquet or {split}.jsonl and not a save_to_disk folder")
    if source.startswith((".", "/", "~")):
        raise VQADataError(f"{source} does not exist")
    return datasets.load_dataset(source, revision=revision, split=split)


def _read_file(path: Path) -> datasets.Dataset:
    if not path.is_file():
        raise VQADataError(f"{path} does not exist")
    kinds = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
    if path.suffix not in kinds:
        raise VQADataError(f"{path}: not a .parquet or .jsonl file")
    return datasets.load_dataset(kinds[path.suffix], data_files=str(path), split="train")


def _open_image(value: Any, folder: str | None) -> Image.Image:
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        if value.get("bytes"):
            return Image.open(io.BytesIO(value["bytes"]))
        value = value["path"]
    if isinstance(value, str) and value:
        path = Path(folder or ".").expanduser() / value
        if not path.is_file():
            raise VQADataError(f"image file {path} does not exist")
        return Image.open(path)
    raise VQADataError(f"no image (got {type(value).__name__})")


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
            float(str(raw).replace(",", ""))
        except ValueError:
            raise VQADataError(f"answer {raw!r} is not a number") from None
    if kind == "math" and not as_math(str(raw)):
        raise VQADataError(f"answer {raw!r} cannot be read as mathematics by math_verify")
    return str(raw).strip()


def _row(row: dict[str, Any], index: int, task_args: Any, template: jinja2.Template, max_pixels: int) -> dict[str, Any]:
    """One training/evaluation row; raises VQADataError naming what is wrong (the caller adds the id)."""
    choices = list(row[task_args.vqa_choices_column] or []) if task_args.vqa_choices_column else []
    text = render(template, row[task_args.vqa_question_column], choices)
    value = row[task_args.vqa_image_column]
    images = [_open_image(v, task_args.vqa_image_folder) for v in (value if isinstance(value, list) else [value])]
    for image in images:
        image.load()
    answer = _answer(row, task_args)
    return make_example(
        _row_id(row, index, task_args),
        text,
        images if isinstance(value, list) else images[0],  # a list column gives TRL's `images`, else `image`
        "before_text",
        max_pixels,
        answer=answer,
        answer_type=task_args.vqa_answer_type,
        tolerance=task_args.vqa_tolerance,
    )


def _row_id(row: dict[str, Any], index: int, task_args: Any) -> str:
    return str(row[task_args.vqa_id_column]) if task_args.vqa_id_column else str(index)


def _features(rows: list[dict[str, Any]]) -> datasets.Features:
    image = {"image": datasets.Image()} if "image" in rows[0] else {"images": [datasets.Image()]}
    return datasets.Features(
        {
            "id": datasets.Value("string"),
            "prompt": PROMPT_FEATURE,
            **image,
            "answer": datasets.Value("string"),
            "answer_type": datasets.Value("string"),
            "tolerance": datasets.Value("float64"),
        }
    )


def load(task_args: Any, split: str, max_pixels: int) -> datasets.Dataset:
    """The rows of the recipe's train or eval split, every one checked; bad rows fail, or are skipped and named."""
    name = task_args.vqa_train_split if split == "train" else task_args.vqa_eval_split
    source = _read(task_args.dataset_name, task_args.dataset_revision, name)
    columns = [task_args.vqa_image_column, task_args.vqa_question_column, task_args.vqa_answer_column]
    columns += [c for c in (task_args.vqa_choices_column, task_args.vqa_id_column) if c]
    missing = [c for c in columns if c not in source.column_names]
    if missing:
        raise VQADataError(f"{task_args.dataset_name} ({name}): missing column(s) {missing}; has {source.column_names}")
    template = _template(task_args)  # compiled once, not per row
    rows, skipped = [], []
    for index, raw in enumerate(source):
        try:
            rows.append(_row(raw, index, task_args, template, max_pixels))
        except TemplateRefused:
            raise
        except (VQADataError, OSError, ValueError) as error:  # ValueError: make_example's RowRefused too
            where = f"VQA row id={_row_id(raw, index, task_args)!r}"
            if not task_args.skip_bad_rows:
                raise VQADataError(f"{where}: {error} (skip_bad_rows: true skips and counts such rows)") from None
            skipped.append(f"{where}: {error}")
    for reason in skipped:
        logger.warning("skipping %s", reason)
    if skipped:
        logger.warning("VQA %s: skipped %d invalid row(s) of %d", name, len(skipped), len(source))
        report_unused(split, "invalid, skipped (skip_bad_rows)", len(skipped))
    if not rows:
        return datasets.Dataset.from_dict({"id": []})
    # In chunks: one `from_list` over thousands of decoded images held them all in memory at once.
    features = _features(rows)
    chunks = [rows[i : i + WRITER_BATCH] for i in range(0, len(rows), WRITER_BATCH)]
    return datasets.concatenate_datasets([datasets.Dataset.from_list(c, features=features) for c in chunks])


def score(row: dict[str, Any], text: str) -> dict[str, Any]:
    """The reward's rule (rewards/vqa.py): gold, the answer read from the completion, right or not."""
    kind = row["answer_type"]
    return {
        "gold": row["answer"],
        "prediction": predicted(text, kind),
        "correct": is_correct(text, row["answer"], kind, row["tolerance"]),
    }


def identity(task_args: Any) -> dict[str, Any]:
    """The source, revision, splits, column mapping, prompt and answer type: what decides the rows."""
    keys = [f.name for f in dataclasses.fields(Options)]
    return {
        "name": task_args.dataset_name,
        "revision": task_args.dataset_revision,
        **{key: getattr(task_args, key) for key in keys},
    }
