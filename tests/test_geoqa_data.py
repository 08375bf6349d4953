"""GeoQA data: the fixture, the loader on every kind of local copy, the seed's fixed subset and prompt, bad rows,
and the `prepare` command. Expected values are computed here independently (pyarrow and numpy), not via the loader.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_script
from PIL import Image

from vision_grpo.data import get_dataset
from vision_grpo.data.geoqa import GeoQADataError, load_split, prepare
from vision_grpo.data.geoqa_fixture import fixture_rows, write_fixture
from vision_grpo.data.prompts_and_images import fill_image
from vision_grpo.recipe.arguments import TaskArguments

MAX_PIXELS = 168 * 168  # the tiny model's processor limit; any value works for the data itself
TRAIN_ROWS = 300
# The seed's template, typed out again here rather than imported, so that a drift in either copy fails.
SEED_PROMPT = (
    "请根据图片解答下面的几何选择题。\n题目：{q}\n选项：\nA. {a}\nB. {b}\nC. {c}\nD. {d}\n"
    "请先进行简单逻辑推理思考，再给出最终答案。"
    "最终选项格式必须是 \\boxed{{A}}、\\boxed{{B}}、\\boxed{{C}} 或 \\boxed{{D}}。"
)


@pytest.fixture(scope="module")
def fixture_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("geoqa") / "geoqa.parquet", train_rows=TRAIN_ROWS)


@pytest.fixture(scope="module")
def raw_rows(fixture_path: Path) -> list[dict]:
    """The fixture's rows as pyarrow reads them (no `datasets` involved)."""
    return pq.read_table(fixture_path).to_pylist()


def task(source: str | Path, **overrides) -> TaskArguments:
    return TaskArguments(task="geoqa", dataset_name=str(source), **overrides)


def expected_subset_ids(rows: list[dict]) -> list[str]:
    test_ids = [str(r["id"]) for r in rows if r["original_split"] == "test"]
    return [test_ids[i] for i in np.random.default_rng(42).permutation(len(test_ids))[len(test_ids) - 100 :]]


def test_fixture_has_the_hub_schema(raw_rows: list[dict], fixture_path: Path) -> None:
    features = datasets.load_dataset("parquet", data_files=str(fixture_path), split="train").features
    assert list(features) == ["id", "subject", "choices", "label", "formal_point", "answer", "comment"] + [
        "original_split",
        "image",
    ]
    assert isinstance(features["image"], datasets.Image) and features["id"].dtype == "int64"
    splits = [r["original_split"] for r in raw_rows]
    assert (splits.count("train"), splits.count("test"), splits.count("val")) == (TRAIN_ROWS, 759, 40)
    assert splits[:TRAIN_ROWS] != ["train"] * TRAIN_ROWS  # splits are interleaved, so order is really tested
    assert len({r["id"] for r in raw_rows}) == len(raw_rows)
    images = [Image.open(io.BytesIO(r["image"]["bytes"])) for r in raw_rows]
    assert {"RGB", "RGBA"} <= {image.mode for image in images}
    assert all(128 <= image.width <= 200 for image in images)
    assert all(len(r["choices"]) == 4 and 0 <= r["label"] <= 3 and "如图" in r["subject"] for r in raw_rows)


def test_eval_is_the_seeds_fixed_subset(fixture_path: Path, raw_rows: list[dict]) -> None:
    rows = get_dataset(task(fixture_path), "eval", MAX_PIXELS)
    assert rows["id"] == expected_subset_ids(raw_rows)
    by_id = {str(r["id"]): r for r in raw_rows}
    assert rows["label"] == [by_id[i]["label"] for i in rows["id"]]


def test_train_is_every_train_row_in_dataset_order(fixture_path: Path, raw_rows: list[dict]) -> None:
    rows = get_dataset(task(fixture_path), "train", MAX_PIXELS)
    assert rows["id"] == [str(r["id"]) for r in raw_rows if r["original_split"] == "train"]


def test_every_kind_of_local_copy_gives_the_same_rows(fixture_path: Path, raw_rows: list[dict], tmp_path: Path) -> None:
    table = pq.read_table(fixture_path)
    shards = tmp_path / "snapshot" / "data"
    shards.mkdir(parents=True)
    for k, start in enumerate(range(0, len(table), 400)):  # names sort in row order, like the Hub's shards
        pq.write_table(table.slice(start, 400), shards / f"train-{k:05d}-of-00003.parquet")
    datasets.load_dataset("parquet", data_files=str(fixture_path), split="train").save_to_disk(tmp_path / "disk")
    expected = expected_subset_ids(raw_rows)
    for source in (shards.parent, tmp_path / "disk"):
        assert [str(i) for i in load_split(str(source), None, "eval")["id"]] == expected, source
        assert len(load_split(str(source), None, "train")) == TRAIN_ROWS


def test_another_test_split_size_fails_unless_allowed(tmp_path: Path) -> None:
    path = write_fixture(tmp_path / "small.parquet", train_rows=4, test_rows=150, val_rows=0)
    with pytest.raises(GeoQADataError, match="150 rows, expected 759"):
        get_dataset(task(path), "eval", MAX_PIXELS)
    rows = get_dataset(task(path, geoqa_test_rows=0), "eval", MAX_PIXELS)
    same_rows = fixture_rows(train_rows=4, test_rows=150, val_rows=0)
    test_ids = [str(r["id"]) for r in same_rows if r["original_split"] == "test"]
    assert rows["id"] == [test_ids[i] for i in np.random.default_rng(42).permutation(150)[50:]]


def test_prompt_is_the_seeds_template(fixture_path: Path, raw_rows: list[dict], tiny_model_path: Path) -> None:
    from vision_grpo.models.processing import load_processor

    row = get_dataset(task(fixture_path), "train", MAX_PIXELS)[0]
    raw = next(r for r in raw_rows if str(r["id"]) == row["id"])
    a, b, c, d = raw["choices"]
    expected = SEED_PROMPT.format(q=raw["subject"].strip(), a=a, b=b, c=c, d=d)
    assert len(row["prompt"]) == 1 and row["prompt"][0]["role"] == "user"  # one user message, no system prompt
    text_part, image_part = row["prompt"][0]["content"]
    assert text_part["type"] == "text" and image_part["type"] == "image"  # text first, then the image
    assert text_part["text"] == expected and not expected.endswith("\n")
    processor = load_processor(str(tiny_model_path), None, None)
    rendered = processor.apply_chat_template(fill_image(row["prompt"], row["image"]), tokenize=False)
    assert expected in rendered and rendered.index(expected) < rendered.index("<|vision_start|>")


def test_questions_with_surrounding_white_space_are_stripped(fixture_path: Path, raw_rows: list[dict]) -> None:
    rows = get_dataset(task(fixture_path), "train", MAX_PIXELS)
    padded = {str(r["id"]) for r in raw_rows if r["subject"] != r["subject"].strip() and r["original_split"] == "train"}
    assert padded, "the fixture should pad some questions with white space"
    for row in rows.filter(lambda i: i in padded, input_columns="id").select(range(3)):
        assert "题目：如图" in row["prompt"][0]["content"][0]["text"]


def test_english_template_is_selectable(fixture_path: Path) -> None:
    text = get_dataset(task(fixture_path, prompt_language="en"), "train", MAX_PIXELS)[0]["prompt"][0]["content"][0]
    assert text["text"].startswith("Answer the following") and "\\boxed{A}" in text["text"]


def test_transparent_diagrams_are_composited_onto_white(fixture_path: Path, raw_rows: list[dict]) -> None:
    rows = get_dataset(task(fixture_path), "train", MAX_PIXELS)
    transparent = [
        str(r["id"])
        for r in raw_rows
        if r["original_split"] == "train" and Image.open(io.BytesIO(r["image"]["bytes"])).mode == "RGBA"
    ]
    image = rows.filter(lambda i: i == transparent[0], input_columns="id")[0]["image"]
    assert image.mode == "RGB" and image.getpixel((1, 1)) == (255, 255, 255)  # corner is transparent in the PNG


# Bad rows are written with pyarrow (no Hugging Face metadata), as a hand-made local copy would be.
def _write(rows: list[dict], path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _small_rows() -> list[dict]:
    return fixture_rows(train_rows=6, test_rows=0, val_rows=0, seed=3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(choices=r["choices"][:3]), "expected 4 choices, got 3"),
        (lambda r: r.update(choices=[*r["choices"], "0"]), "expected 4 choices, got 5"),
        (lambda r: r.update(label=4), "label must be an integer in 0..3, got 4"),
        (lambda r: r.update(image=None), "no image"),
        (lambda r: r.update(image={"bytes": b"\x89PNG\r\n not really", "path": None}), "image does not decode"),
    ],
)
def test_a_bad_row_is_an_error_naming_its_id(tmp_path: Path, change, message: str) -> None:
    rows = _small_rows()
    change(rows[2])
    path = _write(rows, tmp_path / "bad.parquet")
    with pytest.raises(GeoQADataError, match=rf"id='?{rows[2]['id']}'?: {message}"):
        get_dataset(task(path, geoqa_test_rows=0), "train", MAX_PIXELS)


def test_a_letter_label_is_an_error_naming_the_first_id(tmp_path: Path) -> None:
    rows = [{**r, "label": "ABCD"[r["label"]]} for r in _small_rows()]
    with pytest.raises(GeoQADataError, match=rf"id={rows[0]['id']}: label must be an integer in 0..3, got '[A-D]'"):
        get_dataset(task(_write(rows, tmp_path / "letters.parquet")), "train", MAX_PIXELS)


def test_a_missing_column_is_named(tmp_path: Path) -> None:
    rows = [{k: v for k, v in r.items() if k != "label"} for r in _small_rows()]
    with pytest.raises(GeoQADataError, match=r"missing column\(s\) \['label'\]"):
        get_dataset(task(_write(rows, tmp_path / "nolabel.parquet")), "train", MAX_PIXELS)


def test_pickle_files_are_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "geoqa.pk"
    path.write_bytes(b"never unpickled")
    with pytest.raises(GeoQADataError, match="pickle files are never loaded"):
        get_dataset(task(path), "train", MAX_PIXELS)


def test_a_missing_local_copy_says_how_to_build_one(tmp_path: Path) -> None:
    with pytest.raises(GeoQADataError, match="does not exist.*geoqa_fixture --output"):
        get_dataset(task(tmp_path / "nowhere.parquet"), "train", MAX_PIXELS)


def test_skip_bad_rows_skips_and_counts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = _small_rows()
    rows[1]["choices"] = rows[1]["choices"][:3]
    rows[4]["image"] = {"bytes": b"corrupt", "path": None}
    path = _write(rows, tmp_path / "bad.parquet")
    with caplog.at_level(logging.WARNING):
        dataset = get_dataset(task(path, skip_bad_rows=True), "train", MAX_PIXELS)
    assert dataset["id"] == [str(rows[i]["id"]) for i in (0, 2, 3, 5)]
    assert "skipped 2 invalid row(s) of 6" in caplog.text
    # Each skipped row is named with its reason by the checking pass.
    assert f"skipping GeoQA row id={rows[1]['id']!r}: expected 4 choices, got 3" in caplog.text
    assert f"skipping GeoQA row id={rows[4]['id']!r}: image does not decode" in caplog.text


def test_prepare_writes_the_seeds_files_and_refuses_to_overwrite(
    fixture_path: Path, raw_rows: list[dict], tmp_path: Path
) -> None:
    out = tmp_path / "prepared"
    args = ["-m", "vision_grpo.data.geoqa", "prepare", "--source", str(fixture_path), "--output-dir", str(out)]
    run_script([*args, "--revision", "fixture-seed-0"], timeout=300)
    train = pq.read_table(out / "train.parquet").to_pylist()
    assert [r["id"] for r in train] == [r["id"] for r in raw_rows if r["original_split"] == "train"]
    assert [str(i) for i in pq.read_table(out / "test100.parquet")["id"].to_pylist()] == expected_subset_ids(raw_rows)
    manifest = json.loads((out / "geoqa_prepared.json").read_text(encoding="utf-8"))
    assert manifest["revision"] == "fixture-seed-0" and manifest["subset_ids"] == expected_subset_ids(raw_rows)

    # The prepared folder is a source like any other: same training rows, same subset.
    assert get_dataset(task(out), "eval", MAX_PIXELS)["id"] == expected_subset_ids(raw_rows)
    assert len(get_dataset(task(out), "train", MAX_PIXELS)) == TRAIN_ROWS

    refused = run_script(args, timeout=300, check=False)
    assert refused.returncode == 2 and "already exist; pass --force" in refused.stderr
    with pytest.raises(GeoQADataError, match="already exist"):
        prepare(str(fixture_path), None, out, force=False, expected_test_rows=759)
    prepare(str(fixture_path), None, out, force=True, expected_test_rows=759)


def test_prepare_from_the_hub_needs_a_revision(tmp_path: Path) -> None:
    with pytest.raises(GeoQADataError, match="--revision"):
        prepare("hz2475/geoQA", None, tmp_path, force=False, expected_test_rows=759)
