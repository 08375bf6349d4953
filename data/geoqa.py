"""GeoQA (Hugging Face `hz2475/geoQA`): loading, validation, the seed's splits and its prompt.

The seed trains on every `original_split == "train"` row and evaluates on a fixed 100-question subset of the 759
`test` rows: shuffled with `datasets.Dataset.shuffle(seed=42)`, last 100 kept, in that order. It is a subset, not
the full test set; numbers on it are not comparable to results on all 759 questions.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import datasets
from PIL import Image, UnidentifiedImageError

HUB_DATASET = "hz2475/geoQA"
COLUMNS = ("id", "subject", "choices", "label", "formal_point", "answer", "comment", "original_split", "image")
TEST_ROWS = 759
SUBSET_SEED = 42
SUBSET_SIZE = 100
OPTION_LETTERS = "ABCD"

# The seed's template, character for character (no newline after the last full stop).
PROMPT_TEMPLATES = {
    "zh": (
        "请根据图片解答下面的几何选择题。\n"
        "题目：{question}\n"
        "选项：\n"
        "A. {a}\n"
        "B. {b}\n"
        "C. {c}\n"
        "D. {d}\n"
        "请先进行简单逻辑推理思考，再给出最终答案。"
        "最终选项格式必须是 \\boxed{{A}}、\\boxed{{B}}、\\boxed{{C}} 或 \\boxed{{D}}。"
    ),
    "en": (
        "Answer the following multiple-choice geometry question using the figure.\n"
        "Question: {question}\n"
        "Options:\n"
        "A. {a}\n"
        "B. {b}\n"
        "C. {c}\n"
        "D. {d}\n"
        "Reason briefly first, then give the final answer. The final option must be written as "
        "\\boxed{{A}}, \\boxed{{B}}, \\boxed{{C}} or \\boxed{{D}}."
    ),
}


class GeoQADataError(ValueError):
    """A GeoQA source or row that does not match the expected schema."""


def format_question(subject: str, choices: list[str], language: str = "zh") -> str:
    """The seed's prompt text for one question."""
    if language not in PROMPT_TEMPLATES:
        raise GeoQADataError(f"unknown prompt language {language!r}; choose one of {sorted(PROMPT_TEMPLATES)}")
    a, b, c, d = choices
    return PROMPT_TEMPLATES[language].format(question=subject.strip(), a=a, b=b, c=c, d=d)


def load_source(source: str, revision: str | None = None) -> datasets.Dataset:
    """All rows of GeoQA from the Hub (`hz2475/geoQA` at `revision`) or a local copy.

    A local copy is a parquet file, a folder of parquet files, or a `Dataset.save_to_disk` folder; the rows come
    back in the same order as from the Hub, so the fixed subset is the same.
    """
    path = Path(source)
    if path.suffix in (".pk", ".pkl", ".pickle") or (path.is_dir() and any(path.glob("*.pk"))):
        raise GeoQADataError(
            f"{source}: pickle files are never loaded (unpickling runs arbitrary code); use the parquet release "
            f"of {HUB_DATASET} or our `prepare` command"
        )
    if path.is_file() and path.suffix == ".parquet":
        dataset = datasets.load_dataset("parquet", data_files=str(path), split="train")
    elif path.is_dir() and (path / "state.json").exists():
        dataset = datasets.load_from_disk(str(path))
    elif path.is_dir():
        files = sorted(str(p) for p in path.rglob("*.parquet"))
        if not files:
            raise GeoQADataError(f"{source}: folder holds no parquet files and is not a save_to_disk folder")
        dataset = datasets.load_dataset("parquet", data_files=files, split="train")
    elif path.exists() or source.startswith((".", "/")):
        raise GeoQADataError(f"{source}: not a parquet file or folder")
    else:
        dataset = datasets.load_dataset(source, revision=revision, split="train")
    missing = [c for c in COLUMNS if c not in dataset.column_names and c not in ("formal_point", "comment", "answer")]
    if missing:
        raise GeoQADataError(f"{source}: missing column(s) {missing}; expected the {HUB_DATASET} schema {COLUMNS}")
    return dataset


def train_rows(dataset: datasets.Dataset) -> datasets.Dataset:
    """The seed's training set: every `original_split == "train"` row, in dataset order."""
    return dataset.filter(lambda split: split == "train", input_columns="original_split")


def fixed_test_subset(dataset: datasets.Dataset, expected_test_rows: int | None = TEST_ROWS) -> datasets.Dataset:
    """The seed's evaluation subset: the `test` rows shuffled with seed 42, the last 100, in shuffled order.

    Fails if the test split does not have `expected_test_rows` rows (another revision would give other questions);
    pass `None` to accept any size.
    """
    test = dataset.filter(lambda split: split == "test", input_columns="original_split")
    if expected_test_rows is not None and len(test) != expected_test_rows:
        raise GeoQADataError(
            f"the test split has {len(test)} rows, expected {expected_test_rows}: this is not the revision the fixed "
            "subset was defined on (set `geoqa_test_rows: 0` to accept it and get a different subset)"
        )
    if len(test) < SUBSET_SIZE:
        raise GeoQADataError(f"the test split has {len(test)} rows, fewer than the {SUBSET_SIZE} of the subset")
    shuffled = test.shuffle(seed=SUBSET_SEED)
    return shuffled.select(range(len(shuffled) - SUBSET_SIZE, len(shuffled)))


def _decode_image(value: Any) -> Image.Image:
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict) and value.get("bytes"):
        image = Image.open(io.BytesIO(value["bytes"]))
    elif isinstance(value, dict) and value.get("path"):
        image = Image.open(value["path"])
    else:
        raise GeoQADataError("no image")
    image.load()
    return image


def check_row(row: dict[str, Any]) -> Image.Image:
    """Validate one raw row (image column not decoded) and return its decoded image.

    Raises `GeoQADataError` naming the row's id: exactly 4 choices, an integer label in 0..3, a non-empty question
    and an image that decodes are required.
    """
    try:
        choices, label = row["choices"], row["label"]
        if not isinstance(choices, list) or len(choices) != 4:
            got = len(choices) if isinstance(choices, list) else repr(choices)
            raise GeoQADataError(f"expected 4 choices, got {got}")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label <= 3:
            raise GeoQADataError(f"label must be an integer in 0..3, got {label!r}")
        if not isinstance(row["subject"], str) or not row["subject"].strip():
            raise GeoQADataError("empty question")
        try:
            return _decode_image(row["image"])
        except (UnidentifiedImageError, OSError) as error:
            raise GeoQADataError(f"image does not decode ({error})") from error
    except GeoQADataError as error:
        raise GeoQADataError(f"GeoQA row id={row.get('id')!r}: {error}") from None
