"""Data a user gets wrong, refused early by the VQA task, naming the file, row or key and what to do
(docs/bad_inputs.md, "Data")."""

from __future__ import annotations

import json
import logging
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.task_vqa import VQADataError
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

MAX_PIXELS = 168 * 168


def bomb_png(path: Path, side: int = 20_000) -> None:
    """A PNG whose header announces `side`x`side` pixels (400 MP) with almost no data behind it."""
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))  # noqa: E731
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)))


def source(tmp_path: Path, rows: list[dict], raw: bytes | None = None) -> Path:
    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 40), "white").save(folder / "images" / "ok.png")
    bomb_png(folder / "images" / "bomb.png")
    (tmp_path / "outside.png").write_bytes((folder / "images" / "ok.png").read_bytes())
    text = "".join(json.dumps(row) + "\n" for row in rows).encode()
    (folder / "train.jsonl").write_bytes(text + (raw or b""))
    return folder


def load(folder: Path, *extra: str):
    argv = ["--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", str(folder / "images")]
    argv += ["--vqa_answer_type", "number", "--use_cpu", "true", *extra]
    return get_dataset(parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0], "train", MAX_PIXELS)


def row(row_id: str, **fields) -> dict:
    return {"id": row_id, "image": "ok.png", "question": "How many?", "answer": "3", **fields}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (row("b", question=None), r"VQA row id='b': no question \(null or empty\)"),
        (row("b", question="  "), r"VQA row id='b': no question \(null or empty\)"),
        (row("b", image="bomb.png"), r"VQA row id='b': image (of 20000x20000 pixels is )?larger than"),
        (row("b", image="../../outside.png"), r"id='b': image path '../../outside.png' is outside vqa_image_folder"),
        (row("b", image="/etc/hostname"), r"id='b': image path '/etc/hostname' is outside vqa_image_folder"),
    ],
)  # fmt: skip
def test_a_bad_row_is_named_and_skippable_deep_into_the_file(tmp_path: Path, bad: dict, message: str) -> None:
    rows = [row(f"r{i}") for i in range(30)] + [bad]
    folder = source(tmp_path, rows)
    with pytest.raises(VQADataError, match=message):
        load(folder)
    assert len(load(folder, "--skip_bad_rows", "true")) == 30


def test_invalid_utf8_in_a_jsonl_names_the_file_and_line(tmp_path: Path) -> None:
    folder = source(tmp_path, [row("a"), row("b")], raw=b'{"id": "c", "question": "\xff\xfe"}\n')
    with pytest.raises(VQADataError, match=r"train.jsonl: line 3 is not valid UTF-8; re-encode the file as UTF-8"):
        load(folder)


def test_repeated_ids_are_refused_naming_them(tmp_path: Path) -> None:
    folder = source(tmp_path, [row("a"), row("b"), row("a"), row("c"), row("c")])
    with pytest.raises(VQADataError, match=r"2 id\(s\) appear more than once \(e.g. 'a', 'c'\).*vqa_id_column: null"):
        load(folder)


def test_a_missing_id_column_says_how_to_name_it_or_number_the_rows(tmp_path: Path) -> None:
    folder = source(tmp_path, [{k: v for k, v in row("a").items() if k != "id"}])
    with pytest.raises(VQADataError, match=r"missing column\(s\) \['id'\].*vqa_id_column 'id' .* or to null"):
        load(folder)
    assert load(folder, "--vqa_id_column", "null")["id"] == ["0"]  # null: no column, the row's position


def test_one_file_for_training_and_evaluation_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = source(tmp_path, [row("a")])
    argv = ["--task", "vqa", "--dataset_name", str(folder / "train.jsonl"), "--vqa_image_folder"]
    argv += [str(folder / "images"), "--vqa_answer_type", "number", "--use_cpu", "true"]
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]
    with caplog.at_level(logging.WARNING, logger="vision_grpo.data.task_vqa"):
        get_dataset(args, "eval", MAX_PIXELS)
    assert (
        "training and evaluation both read all of it" in caplog.text and "Put `{split}` in dataset_name" in caplog.text
    )
