"""The pass's container checks (data/encoded_images.py): the size training will see, read without decoding, is the
size `normalize_image` returns, and a JPEG, PNG or WebP cut short or damaged is refused by the pass, naming its row;
a bitstream damaged inside whole chunks passes `vqa_image_check: structure` and fails when its row is read, naming
it, while under `skip_bad_rows` the pass finds it (a JPEG's; an evaluation row's WebP) or the reader skips the row,
replacing it and recording it for the end record and the next pass (a training row's WebP), and
`vqa_image_check: decode` finds it before training."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
import pytest
from conftest import run_script
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile, WebPImagePlugin
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import encoded_images, get_dataset, get_rows
from vision_grpo.data.prompts_and_images import normalize_image, normalized_size
from vision_grpo.data.reading import UnreadableRow, found_when_read
from vision_grpo.data.task_vqa import VQADataError
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe

ORIENTATION = 0x0112
FORMATS = ["JPEG", "PNG", "WEBP"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def encoded(kind: str, size: tuple[int, int], orientation: int = 1, mode: str = "RGB") -> bytes:
    """A noisy image (so that it does not compress to nothing) of `kind`, with its EXIF orientation."""
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels).convert(mode)
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    buffer = io.BytesIO()
    image.save(buffer, kind, exif=exif)
    return buffer.getvalue()


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(FORMATS),
    width=st.integers(1, 300),
    height=st.integers(1, 300),
    max_pixels=st.integers(1, 20_000),
    orientation=st.integers(1, 8),
)
def test_the_header_size_is_the_size_normalize_image_returns(
    kind: str, width: int, height: int, max_pixels: int, orientation: int
) -> None:
    data = encoded(kind, (width, height), orientation)
    expected = normalize_image(Image.open(io.BytesIO(data)), max_pixels).size
    with undecodable():
        assert normalized_size(Image.open(io.BytesIO(data)), max_pixels, decode=False) == expected


@contextlib.contextmanager
def undecodable() -> Iterator[None]:
    """Any decode of an opened file fails the test."""

    def refused(image: Image.Image) -> None:
        raise AssertionError(f"{image.format} image decoded")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ImageFile.ImageFile, "load", refused)
        patch.setattr(WebPImagePlugin.WebPImageFile, "load", refused)
        yield


@pytest.mark.parametrize("mode", ["L", "LA", "P", "RGBA", "1", "I;16"])
def test_every_mode_png_holds_is_sized_without_decoding(mode: str) -> None:
    data = encoded("PNG", (37, 23), 6, mode)
    expected = normalize_image(Image.open(io.BytesIO(data)), 500).size
    with undecodable():
        assert normalized_size(Image.open(io.BytesIO(data)), 500, decode=False) == expected


def damaged(kind: str) -> dict[str, bytes]:
    """Whole, cut and damaged files of `kind`: `inside` keeps every container length and checksum right."""
    whole = encoded(kind, (64, 48))
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0xFF
    files = {"whole": whole, "cut": whole[: len(whole) // 2], "flipped": bytes(flipped)}
    return files


def short_bitstream() -> bytes:
    """A WebP whose VP8 bitstream is cut to half inside a container whose lengths say so: it opens (its frame
    header is whole) and fails to decode."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buffer, "WEBP")
    whole = buffer.getvalue()
    assert whole[12:16] == b"VP8 "
    keep = struct.unpack_from("<I", whole, 16)[0] // 2 & ~1
    return b"RIFF" + struct.pack("<I", 12 + keep) + b"WEBPVP8 " + struct.pack("<I", keep) + whole[20 : 20 + keep]


def ids(rows: datasets.Dataset) -> list[str]:
    """The rows' ids, without reading a row through the transform (which decodes its images)."""
    return rows.with_format("arrow")["id"].to_pylist()


def vqa_args(folder: Path, images: dict[str, bytes], *keys: str, skip: bool = True) -> TaskArguments:
    features = datasets.Features(
        {"id": datasets.Value("string"), "image": datasets.Image(), "question": datasets.Value("string"),
         "answer": datasets.Value("string")}
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": name, "image": {"bytes": data, "path": None}, "question": "How many?", "answer": "2"}
            for name, data in images.items()]  # fmt: skip
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(folder / "train.parquet"))
    argv = ["--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", "null", "--vqa_id_column", "id",
            "--vqa_answer_type", "number", "--use_cpu", "true", "--skip_bad_rows", str(skip), *keys]  # fmt: skip
    return parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]


@pytest.mark.parametrize("kind", FORMATS)
def test_a_cut_or_damaged_file_is_refused_by_the_pass_without_decoding(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = damaged(kind)
    rows = get_dataset(vqa_args(tmp_path, files), "train", 10_000)
    skipped = {line.split("id=")[1].split(":")[0] for line in caplog.messages if line.startswith("skipping")}
    assert "'cut'" in skipped and "'whole'" not in skipped
    if kind == "PNG":  # a byte flipped anywhere breaks a CRC; in a JPEG or WebP bitstream it may decode (or not)
        assert "'flipped'" in skipped
    assert "whole" in rows["id"]
    if kind != "WEBP":  # Pillow opens a WebP by reading its frame header: a cut one fails there, in its words
        assert any("image file is truncated" in line for line in caplog.messages)


def test_a_bitstream_damaged_inside_whole_chunks_fails_when_read_or_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    whole = damaged("WEBP")["whole"]
    files = {"a": whole, "inside": short_bitstream(), "c": encoded("WEBP", (32, 32))}
    with pytest.raises(OSError):
        Image.open(io.BytesIO(files["inside"])).load()  # it really does not decode
    # Without skip_bad_rows the pass reads the container only; the row fails when read, naming it.
    rows = get_dataset(vqa_args(tmp_path / "structure", files, skip=False), "train", 10_000)
    assert ids(rows) == ["a", "inside", "c"]
    with pytest.raises(VQADataError, match=r"VQA row id='inside': its image does not decode .* skip_bad_rows: true"):
        rows[1]
    # Under skip_bad_rows a training row's WebP is left to the reader: the row is replaced by the next readable one
    # (the same one however often, and wherever, it is read), named, and recorded for the run's end record.
    args = vqa_args(tmp_path / "skip", files)
    with caplog.at_level(logging.WARNING, logger="vision_grpo.data.prepared"):
        rows = get_dataset(args, "train", 10_000)
        assert ids(rows) == ["a", "inside", "c"] and found_when_read(rows) == {}
        batch = rows[[1, 0, 1]]
    assert batch["id"] == ["c", "a", "c"] and batch["image"][0].size == (32, 32)
    assert rows[1]["id"] == "c" and rows[2]["id"] == "c"
    assert [line for line in caplog.messages if "id='inside'" in line] == [
        next(line for line in caplog.messages if line.startswith("skipping row id='inside' (skip_bad_rows)"))
    ]  # warned once in this process, however often read
    assert list(found_when_read(rows)) == ["inside"] and "does not decode" in found_when_read(rows)["inside"]
    # The next start's pass leaves it out, named and counted like any row the pass refused.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vision_grpo.data.task_vqa"):
        again = get_rows(args, "train", 10_000)
    assert ids(again.dataset) == ["a", "c"] and found_when_read(again.dataset) == {}
    assert again.unused == {"invalid, skipped (skip_bad_rows)": 1} and again.unused_ids == {
        "invalid, skipped (skip_bad_rows)": ["inside"]
    }
    assert "found when an earlier launch read the row" in caplog.text
    # where the record is and how to clear it, once the image is repaired
    assert ".unreadable.jsonl: once its image is repaired, delete that file (or this id's line)" in caplog.text
    # Evaluation rows are never replaced (each is scored under its id): the pass decodes their WebP and skips it;
    # vqa_image_check: decode finds it in the pass for any split.
    evaluated = get_dataset(vqa_args(tmp_path / "eval", files, "--vqa_eval_split", "train"), "eval", 10_000)
    assert ids(evaluated) == ["a", "c"]
    decoded = get_dataset(vqa_args(tmp_path / "decode", files, "--vqa_image_check", "decode"), "train", 10_000)
    assert ids(decoded) == ["a", "c"]


def test_a_training_split_with_no_readable_row_fails_when_read(tmp_path: Path) -> None:
    rows = get_dataset(vqa_args(tmp_path, {"inside": short_bitstream()}), "train", 10_000)
    with pytest.raises(UnreadableRow, match=r"no row of the rows cache .*\.arrow can be read"):
        rows[0]


def test_a_jpeg_that_only_decoding_refuses_is_skipped_by_the_pass_under_skip_bad_rows(tmp_path: Path) -> None:
    whole = damaged("JPEG")["whole"]
    table = whole.index(b"\xff\xc4")  # the first Huffman table: counts that promise more codes than it holds
    bogus = whole[: table + 5] + b"\xff" * 16 + whole[table + 21 :]
    with pytest.raises(OSError):
        Image.open(io.BytesIO(bogus)).load()
    files = {"whole": whole, "bogus": bogus}
    assert len(get_dataset(vqa_args(tmp_path / "structure", files, skip=False), "train", 10_000)) == 2
    rows = get_dataset(vqa_args(tmp_path / "skip", files), "train", 10_000)
    assert list(rows["id"]) == ["whole"]
    assert rows[0]["image"].size == Image.open(io.BytesIO(whole)).size  # the draft decode left the size as read


def test_an_unknown_image_check_is_refused() -> None:
    with pytest.raises(RecipeError, match=r"vqa_image_check: 'full' is not one of \['structure', 'decode'\]"):
        TaskArguments(task="vqa", vqa_image_check="full")


def test_the_log_says_what_the_pass_did_not_decode(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vision_grpo.data.task_vqa"):
        get_dataset(vqa_args(tmp_path, {"whole": damaged("PNG")["whole"]}), "train", 10_000)
    assert "not decoded (vqa_image_check: structure)" in caplog.text


@pytest.mark.slow
def test_training_skips_a_row_found_unreadable_when_read_and_the_manifest_counts_it(tmp_path: Path) -> None:
    """Two GRPO steps of the tiny VQA recipe on 4 WebP rows (2 prompts a step: every row read), one of them damaged
    inside its bitstream, under skip_bad_rows: the run ends, its end record names the row; the next run's pass
    leaves it out and its start record counts it."""
    files = {"a": encoded("WEBP", (64, 48)), "inside": short_bitstream(), "c": encoded("WEBP", (48, 64))}
    files["d"] = encoded("WEBP", (56, 56))
    vqa_args(tmp_path / "data", files)  # writes the source
    argv = ["recipes/train.py", "--config", "recipes/vqa/tiny_clevr_count.yaml", "--dataset_name",
            str(tmp_path / "data"), "--vqa_image_column", "image", "--vqa_image_folder", "null", "--vqa_id_column",
            "id", "--skip_bad_rows", "true", "--max_steps", "2", "--save_steps", "2", "--report_to", "none",
            "--output_dir", str(tmp_path / "runs")]  # fmt: skip
    env = {"HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    first = run_script([*argv, "--run_name", "first"], env=env)
    assert "skipping row id='inside' (skip_bad_rows), found when read" in first.stderr
    manifest = json.loads((tmp_path / "runs" / "first" / "manifest.json").read_text())
    assert manifest["global_step"] == 2 and list(manifest["rows_skipped_when_read"]) == ["inside"]
    assert "train" not in manifest["rows_unused"]
    run_script([*argv, "--run_name", "second"], env=env)
    manifest = json.loads((tmp_path / "runs" / "second" / "manifest.json").read_text())
    assert manifest["rows_unused"]["train"] == {"invalid, skipped (skip_bad_rows)": 1}
    assert manifest["global_step"] == 2 and manifest["rows_skipped_when_read"] == {}


def test_pillows_png_verify_misses_what_the_chunk_walk_finds_which_is_why_the_walk_stays() -> None:
    """Pillow's open and `verify()` check every chunk's CRC up to IEND as the walk does (data/encoded_images.py, at
    the same speed), but a PNG without pixel data fails there with an IndexError that names nothing, IEND's own CRC
    goes unchecked, and the walk alone tells whether metadata follows the pixels (where the orientation is read only
    after decoding). The day Pillow names these, this fails and the walk can give way to it."""
    whole = encoded("PNG", (64, 48))
    end = whole.index(b"IEND") - 4
    no_pixels, bad_end = whole[:33] + whole[end:], whole[:-1] + bytes([whole[-1] ^ 1])

    def pillow(data: bytes) -> BaseException | None:
        try:
            Image.open(io.BytesIO(data)).verify()
        except Exception as error:
            return error
        return None

    assert isinstance(pillow(no_pixels), IndexError) and pillow(bad_end) is None
    with memoryview(no_pixels) as pixels, memoryview(bad_end) as end_chunk:
        assert encoded_images._png_problem(pixels) == "corrupt PNG file (no IDAT chunk)"
        assert "CRC mismatch in its IEND chunk" in encoded_images._png_problem(end_chunk)
