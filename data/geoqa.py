"""GeoQA (Hugging Face `hz2475/geoQA`): loading, validation, the seed's splits and its prompt.

The seed trains on every `original_split == "train"` row and evaluates on a fixed 100-question subset of the 759
`test` rows: shuffled with `datasets.Dataset.shuffle(seed=42)`, last 100 kept, in that order. It is a subset, not
the full test set; numbers on it are not comparable to results on all 759 questions.

One loader serves every source: the Hub (at a pinned revision), a local parquet file or folder, a `save_to_disk`
folder, or a folder written by `prepare` (below), so offline clusters and the tests take the same path.

    python -m vision_grpo.data.geoqa prepare --revision <commit> --output-dir <dir> [--source <hub id or path>]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute as pc
from PIL import Image, UnidentifiedImageError

from vision_grpo.data import hub, prepared, report_unused, warn_split_overlap
from vision_grpo.data.prompts_and_images import (
    ImageTooLarge,
    RowRefused,
    check_aspect_ratio,
    check_decode_size,
    special_token_in,
)

logger = logging.getLogger(__name__)

HUB_DATASET = "hz2475/geoQA"
COLUMNS = ("id", "subject", "choices", "label", "formal_point", "answer", "comment", "original_split", "image")
# The columns we read; `formal_point`, `answer` (the worked solution, never shown to the model) and `comment` may
# be absent from a local copy.
# What makes two rows the same question for the overlap warning: the id, then the question text with the diagram.
OVERLAP = ("id", "subject", "image")
REQUIRED_COLUMNS = ("id", "subject", "choices", "label", "original_split", "image")
TEST_ROWS = 759
SUBSET_SEED = 42
SUBSET_SIZE = 100
OPTION_LETTERS = "ABCD"
# What `prepare` writes; a folder holding `SUBSET_FILE` is read as a prepared folder.
TRAIN_FILE = "train.parquet"
SUBSET_FILE = "test100.parquet"
MANIFEST_FILE = "geoqa_prepared.json"
PICKLE_SUFFIXES = (".pk", ".pkl", ".pickle")
LOCAL_SUFFIXES = (".parquet", ".arrow", *PICKLE_SUFFIXES)

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


def _looks_local(source: str) -> bool:
    """A path rather than a Hub id (`owner/name`): a path prefix, a data-file suffix, or not exactly one slash."""
    return source.startswith((".", "/", "~")) or source.count("/") != 1 or Path(source).suffix in LOCAL_SUFFIXES


def _read_parquet(files: list[str]) -> datasets.Dataset:
    return prepared.read_parquet([Path(file) for file in files])


def _read_local(source: str) -> datasets.Dataset:
    path = Path(source).expanduser()
    if path.suffix in PICKLE_SUFFIXES or (path.is_dir() and any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir())):
        raise GeoQADataError(
            f"{source}: pickle files are never loaded (unpickling runs arbitrary code); use the parquet release "
            f"of {HUB_DATASET} or our `prepare` command"
        )
    if not path.exists():
        raise GeoQADataError(
            f"{source} does not exist. For the offline fixture run "
            f"`python -m vision_grpo.data.geoqa_fixture --output {source}`; for the real data run "
            "`python -m vision_grpo.data.geoqa prepare --revision <commit> --output-dir <dir>` where the Hub is up"
        )
    if path.is_file() and path.suffix == ".parquet":
        return _read_parquet([str(path)])
    if path.is_dir() and (path / "state.json").exists():
        return datasets.load_from_disk(str(path))
    if path.is_dir():
        # Sorted, so a Hub snapshot's `data/train-0000k-of-0000n.parquet` shards keep the Hub's row order.
        files = sorted(str(p) for p in path.rglob("*.parquet"))
        if not files:
            raise GeoQADataError(f"{source}: folder holds no parquet files and is not a save_to_disk folder")
        return _read_parquet(files)
    raise GeoQADataError(f"{source}: not a parquet file, a folder of parquet files or a save_to_disk folder")


def _check_columns(dataset: datasets.Dataset, source: str) -> datasets.Dataset:
    missing = [c for c in REQUIRED_COLUMNS if c not in dataset.column_names]
    if missing:
        raise GeoQADataError(f"{source}: missing column(s) {missing}; expected the {HUB_DATASET} schema {COLUMNS}")
    return dataset


def load_source(source: str, revision: str | None = None) -> datasets.Dataset:
    """All rows of GeoQA from the Hub (`hz2475/geoQA` at `revision`) or a local copy, in the Hub's row order.

    A local copy is a parquet file, a folder of parquet files, or a `Dataset.save_to_disk` folder; `revision` only
    applies to the Hub (a local copy is whatever revision it was made from).
    """
    if _looks_local(source) or Path(source).expanduser().exists():
        if revision:
            logger.info("GeoQA: local copy %s; dataset_revision %s is not checked against it", source, revision)
        dataset = _read_local(source)
    else:
        if not revision:
            logger.warning("GeoQA: %s without a pinned revision; the fixed subset may drift with `main`", source)
        try:
            dataset = hub.load(source, revision, "train")
        except (ConnectionError, hub.HubDataUnavailable) as error:  # ConnectionError: the Hub is unreachable
            raise GeoQADataError(
                f"GeoQA: {error}. A local copy, made where the Hub is reachable: `python -m vision_grpo.data.geoqa "
                f"prepare --source {source} --revision <commit> --output-dir <dir>`"
            ) from error
    return _check_unique_ids(_check_columns(dataset, source), source)


def _check_unique_ids(dataset: datasets.Dataset, source: str) -> datasets.Dataset:
    """Refuse a source whose ids repeat: two copies of the data in one folder would train on every row twice and
    make the fixed subset ambiguous."""
    repeated = prepared.repeated_values(dataset, "id")
    if repeated:
        path = Path(source).expanduser()
        files = sorted(str(p.relative_to(path)) for p in path.rglob("*.parquet")) if path.is_dir() else []
        read = f"; files read: {', '.join(files)}" if files else ""
        raise GeoQADataError(
            f"{source}: {len(repeated)} id(s) appear more than once (e.g. {', '.join(map(str, repeated[:5]))}){read}. "
            "Is a second copy of the data in the same folder? Keep one copy, or point `dataset_name` at one file"
        )
    return dataset


def log_unused_rows(dataset: datasets.Dataset, source: str) -> dict[str, int]:
    """Count the rows neither trained on nor evaluated, by reason, and say so: `val` rows (the seed uses none) and
    rows whose `original_split` is missing or unknown (named by id, since they are probably a data error)."""
    counted = pc.value_counts(dataset.with_format("arrow")["original_split"])  # not one row at a time
    splits = dict(zip(counted.field("values").to_pylist(), counted.field("counts").to_pylist(), strict=True))
    unknown = {split: n for split, n in splits.items() if split not in ("train", "test", "val")}
    counts = {"val (unused by the seed)": splits.get("val", 0), "no or unknown original_split": sum(unknown.values())}
    if counts["no or unknown original_split"]:
        pairs = zip(dataset["id"], dataset["original_split"], strict=True)
        ids = [row_id for row_id, split in pairs if split in unknown]
        logger.warning(
            "GeoQA %s: %d row(s) have original_split %s and are neither trained on nor evaluated (ids %s%s)",
            source,
            len(ids),
            sorted(map(repr, unknown)),
            ", ".join(map(str, ids[:10])),
            ", ..." if len(ids) > 10 else "",
        )
    if counts["val (unused by the seed)"]:
        logger.info("GeoQA %s: %d val row(s) not used (the seed trains on train only)", source, splits["val"])
    return counts


def train_rows(dataset: datasets.Dataset) -> datasets.Dataset:
    """The seed's training set: every `original_split == "train"` row, in dataset order."""
    return dataset.filter(lambda split: split == "train", input_columns="original_split")


def fixed_test_subset(dataset: datasets.Dataset, expected_test_rows: int | None = TEST_ROWS) -> datasets.Dataset:
    """The seed's evaluation subset: the `test` rows shuffled with seed 42, the last 100, in shuffled order.

    `Dataset.shuffle(seed=42)` permutes with `numpy.random.default_rng(42).permutation(n)`, so the subset is the
    test rows at positions `default_rng(42).permutation(759)[659:]`. Fails if the test split does not have
    `expected_test_rows` rows (another revision would give other questions); pass `None` to accept any size.
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


def subset_ids(subset: datasets.Dataset) -> list[str]:
    """The ids of the fixed subset's questions, in evaluation order (as strings, like our examples' `id`)."""
    return [str(value) for value in subset["id"]]


def _prepared_dir(source: str) -> Path | None:
    path = Path(source).expanduser()
    return path if path.is_dir() and (path / SUBSET_FILE).exists() else None


def load_split(
    source: str, revision: str | None, split: str, expected_test_rows: int | None = TEST_ROWS
) -> datasets.Dataset:
    """The raw rows of `split`: `train` (the training set) or `eval` (the fixed 100-question subset).

    A folder written by `prepare` already holds both, so they are read as they are; any other source is split here
    (rows of no split, and `val` rows, are reported as unused).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be `train` or `eval`, got {split!r}")
    prepared = _prepared_dir(source)
    if prepared is not None:
        if split == "train":
            return train_rows(_check_columns(_read_parquet([str(prepared / TRAIN_FILE)]), source))
        subset = _check_columns(_read_parquet([str(prepared / SUBSET_FILE)]), source)
        if len(subset) != SUBSET_SIZE:
            raise GeoQADataError(f"{prepared / SUBSET_FILE}: {len(subset)} rows, expected {SUBSET_SIZE}")
        warn_split_overlap(train_rows(_read_parquet([str(prepared / TRAIN_FILE)])), subset, *OVERLAP, source)
        return subset
    dataset = load_source(source, revision)
    for reason, count in log_unused_rows(dataset, source).items():
        report_unused(split, reason, count)
    if split == "train":
        return train_rows(dataset)
    subset = fixed_test_subset(dataset, expected_test_rows)
    warn_split_overlap(train_rows(dataset), subset, *OVERLAP, source)
    return subset


def open_image(value: Any) -> Image.Image:
    """The row's image opened, not decoded: from its bytes, or its file."""
    if isinstance(value, Image.Image):
        return value
    return Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") else Image.open(value["path"])


def _decode_image(value: Any) -> Image.Image:
    """The row's image, fully decoded (so a truncated file fails here, not in the middle of training)."""
    image = open_image(value)
    check_decode_size(image)
    image.load()
    return image


def check_row(row: dict[str, Any]) -> Image.Image:
    """Validate one raw row (image column not decoded) and return its decoded image.

    Raises `GeoQADataError` naming the row's id: exactly 4 string choices, an integer label in 0..3, a non-empty
    question and an image that decodes are required.
    """
    try:
        choices, label = row["choices"], row["label"]
        if not isinstance(choices, list) or len(choices) != 4:
            got = len(choices) if isinstance(choices, list) else repr(choices)
            raise GeoQADataError(f"expected 4 choices, got {got}")
        if not all(isinstance(choice, str) for choice in choices):
            raise GeoQADataError(f"choices must be strings, got {choices!r}")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label <= 3:
            raise GeoQADataError(f"label must be an integer in 0..3, got {label!r}")
        if not isinstance(row["subject"], str) or not row["subject"].strip():
            raise GeoQADataError("empty question")
        image = row["image"]
        has_image = isinstance(image, Image.Image) or (
            isinstance(image, dict) and bool(image.get("bytes") or image.get("path"))
        )
        if not has_image:
            raise GeoQADataError("no image")
        texts = [row["subject"], *choices]
        token = next((found for found in map(special_token_in, texts) if found), None)
        if token:
            raise GeoQADataError(f"the text holds the special token {token}, which the tokenizer would read as control")
        try:
            decoded = _decode_image(image)
        except ImageTooLarge as error:
            raise GeoQADataError(str(error)) from error
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
            raise GeoQADataError(f"image does not decode ({error})") from error
        try:
            check_aspect_ratio(decoded.size)
        except RowRefused as error:
            raise GeoQADataError(str(error)) from error
        return decoded
    except GeoQADataError as error:
        raise GeoQADataError(f"GeoQA row id={row.get('id')!r}: {error}") from None


def prepare(source: str, revision: str | None, output_dir: Path, force: bool, expected_test_rows: int | None) -> dict:
    """Write the seed's two files (`train.parquet`, `test100.parquet`) and a manifest; returns the manifest.

    Like the seed's download step, but every column (including `original_split`) is kept, and the manifest records
    the source, the revision and the subset's ids. Refuses to overwrite earlier output unless `force`.
    """
    if not _looks_local(source) and not revision:
        raise GeoQADataError(f"{source}: pass --revision <commit> so the prepared files name the data they hold")
    outputs = [output_dir / name for name in (TRAIN_FILE, SUBSET_FILE, MANIFEST_FILE)]
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not force:
        raise GeoQADataError(f"{existing} already exist; pass --force to overwrite")
    dataset = load_source(source, revision)
    train, subset = train_rows(dataset), fixed_test_subset(dataset, expected_test_rows)
    output_dir.mkdir(parents=True, exist_ok=True)
    train.to_parquet(str(output_dir / TRAIN_FILE))
    subset.to_parquet(str(output_dir / SUBSET_FILE))
    manifest = {
        "source": source,
        "revision": revision,
        "rows": len(dataset),
        "train_rows": len(train),
        "test_rows": sum(1 for split in dataset["original_split"] if split == "test"),
        "subset_seed": SUBSET_SEED,
        "subset_ids": subset_ids(subset),
    }
    (output_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vision_grpo.data.geoqa", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help=f"write {TRAIN_FILE} and {SUBSET_FILE} for one revision")
    prep.add_argument("--source", default=HUB_DATASET, help="Hub id or local copy (parquet, folder, save_to_disk)")
    prep.add_argument("--revision", default=None, help="Hub commit to pin (required for a Hub source)")
    prep.add_argument("--output-dir", type=Path, required=True)
    prep.add_argument("--force", action="store_true", help="overwrite files written earlier")
    prep.add_argument("--test-rows", type=int, default=TEST_ROWS, help="expected test rows; 0 accepts any")
    args = parser.parse_args(argv)
    try:
        manifest = prepare(args.source, args.revision, args.output_dir, args.force, args.test_rows or None)
    except GeoQADataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{args.output_dir / TRAIN_FILE}: {manifest['train_rows']} rows")
    print(f"{args.output_dir / SUBSET_FILE}: {SUBSET_SIZE} rows (fixed subset of {manifest['test_rows']} test rows)")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
