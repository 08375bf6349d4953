"""A second start does not grow with the rows: it reads no row one by one (the checked rows' ids, errors and repeated
ids come from whole Arrow columns), and the every-prompt image-token check (`token_check_samples: -1`) renders every
prompt once, then only a sample while nothing that decides it changed."""

from __future__ import annotations

import io
import json
import logging
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from transformers import AutoConfig
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset, prepared
from vision_grpo.models.embedded import TINY_MODEL, resolve_model_path
from vision_grpo.models.loading import get_processor, max_pixels_of
from vision_grpo.models.visual_tokens import RECHECK_SAMPLES, VisualTokenMismatch, check_visual_tokens
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

ROWS = 300
BAD = {7, 150, 299}  # rows whose answer is not a number


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def source(folder: Path, rows: int, bad: set[int] = frozenset()) -> list[str]:
    """A VQA source of `rows` rows sharing one tiny image, and the recipe keys that read it."""
    (folder / "images").mkdir(parents=True)
    Image.new("RGB", (40, 30), "white").save(folder / "images" / "a.png")
    lines = [
        {"id": f"r{i}", "image": "a.png", "question": "How many?", "answer": "x" if i in bad else str(i)}
        for i in range(rows)
    ]
    (folder / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return [
        "--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", str(folder / "images"),
        "--vqa_answer_type", "number", "--skip_bad_rows", "true", "--use_cpu", "true",
    ]  # fmt: skip


class RowReads:
    """Rows read one at a time from any `datasets.Dataset`: iterated (as iterating `dataset[column]`, a `Column`,
    does) or indexed by position."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        iterate, getitem = datasets.Dataset.__iter__, datasets.Dataset._getitem

        def counted_iter(dataset: datasets.Dataset) -> Iterator:
            for row in iterate(dataset):
                self.count += 1
                yield row

        def counted_getitem(dataset: datasets.Dataset, key, **kwargs):
            self.count += isinstance(key, int)
            return getitem(dataset, key, **kwargs)

        monkeypatch.setattr(datasets.Dataset, "__iter__", counted_iter)
        monkeypatch.setattr(datasets.Dataset, "_getitem", counted_getitem)


def test_a_second_start_reads_no_row_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), source(tmp_path / "data", ROWS, BAD))[0]
    get_dataset(args, "train", 168 * 168)  # the first start: the checking pass, cached
    reads = RowReads(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vision_grpo.data"):
        rows = get_dataset(args, "train", 168 * 168)
    assert "read from the cache" in caplog.text
    assert reads.count == 0, f"{reads.count} rows read one by one at a second start of {ROWS}"
    # What the columns gave is what the rows said: the bad rows named and left out, the rest in source order.
    assert all(f"skipping VQA row id='r{i}'" in caplog.text for i in BAD)
    assert len(rows) == ROWS - len(BAD) and rows[6]["id"] == "r6" and rows[7]["id"] == "r8"


@pytest.fixture
def processor():
    return get_processor(ModelConfig(model_name_or_path=TINY_MODEL), TaskArguments())


class Renders:
    """Prompts `processor` renders."""

    def __init__(self, processor, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        render = processor.apply_chat_template

        def counted(*args, **kwargs):
            self.count += 1
            return render(*args, **kwargs)

        monkeypatch.setattr(processor, "apply_chat_template", counted)


def test_every_prompt_is_checked_once_then_a_sample_until_a_deciding_setting_changes(
    tmp_path: Path, processor, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = RECHECK_SAMPLES + 8
    argv = source(tmp_path / "data", rows)
    # The last row, beyond any sample, has the one larger image: 112x112 is 12,544 pixels, the others 3,136.
    Image.new("RGB", (112, 112), "white").save(tmp_path / "data" / "images" / "big.png")
    path = tmp_path / "data" / "train.jsonl"
    path.write_text(path.read_text().replace(f'"r{rows - 1}", "image": "a.png"', f'"r{rows - 1}", "image": "big.png"'))
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]
    dataset = get_dataset(args, "train", max_pixels_of(processor))
    model_config = AutoConfig.from_pretrained(resolve_model_path(TINY_MODEL))
    renders = Renders(processor, monkeypatch)

    def checked(limits: tuple = (None, None)) -> tuple[int, int]:
        before = renders.count
        return check_visual_tokens(dataset, processor, model_config, -1, {}, limits), renders.count - before

    # Every prompt is checked, rendering one of each distinct (prompt form, image sizes): two here.
    assert checked() == (rows, 2)
    assert checked() == (RECHECK_SAMPLES, RECHECK_SAMPLES)  # a later start: every prompt passed with these
    dataset = get_dataset(args, "train", max_pixels_of(processor))  # another start's dataset: the same rows
    assert checked() == (RECHECK_SAMPLES, RECHECK_SAMPLES)
    # A deciding setting changed: every prompt again, so the last row's image over the new limit is named; a check
    # that failed is not remembered.
    for _ in range(2):
        with pytest.raises(VisualTokenMismatch, match=f"example r{rows - 1} .*outside the recipe's limits"):
            checked((None, 5000))
    assert checked((1, None)) == (rows, 2)


def test_a_parquet_source_in_large_row_groups_is_named_with_its_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(prepared, "LARGE_ROW_GROUP", 20_000)
    images = [{"bytes": random.Random(i).randbytes(200), "path": None} for i in range(200)]  # 40 kB: over 20 kB
    table = pa.table({"id": [str(i) for i in range(200)], "image": images})
    for name, group in (("one_group.parquet", 200), ("small_groups.parquet", 20)):
        pq.write_table(table, tmp_path / name, row_group_size=group)
    with caplog.at_level(logging.WARNING, logger="vision_grpo.data.prepared"):
        prepared.read_parquet([tmp_path / "small_groups.parquet"])
        assert not caplog.records
        prepared.read_parquet([tmp_path / "one_group.parquet"])
    assert "one_group.parquet: its largest row group holds 200 rows" in caplog.text
    assert "(1 row group(s), 200 rows)" in caplog.text and "row_group_size=100" in caplog.text


def test_the_row_group_warning_comes_only_with_the_conversion_it_warns_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(prepared, "LARGE_ROW_GROUP", 20_000)
    noise = [Image.frombytes("L", (16, 16), random.Random(i).randbytes(256)) for i in range(200)]  # ~0.3 kB PNGs
    rows = {"id": [str(i) for i in range(200)], "image": noise, "question": ["How many?"] * 200, "answer": ["2"] * 200}
    folder = tmp_path / "data"
    folder.mkdir()
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "train.parquet"), batch_size=200)  # one row group
    argv = ["--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", "null", "--vqa_id_column", "id",
            "--vqa_answer_type", "number", "--use_cpu", "true"]  # fmt: skip
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]
    warned = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vision_grpo.data.prepared"):
            get_dataset(args, "train", 168 * 168)
        warned.append("its largest row group holds 200 rows" in caplog.text)
    assert warned == [True, False]  # the second start reads the Arrow cache the first made: nothing to warn of
    (folder / "train.parquet").touch()  # a changed file (its modification time) is converted again: warned again
    with caplog.at_level(logging.WARNING, logger="vision_grpo.data.prepared"):
        get_dataset(args, "train", 168 * 168)
    assert "its largest row group holds 200 rows" in caplog.text


class Reads(io.RawIOBase):
    """A file whose reads are recorded (sizes), as `datasets`' parquet builder opens it."""

    sizes: list[int] = []

    def __init__(self, path: str, mode: str = "rb") -> None:
        self.file = open(path, mode)  # noqa: SIM115 (closed with this object)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def readinto(self, buffer) -> int:
        count = self.file.readinto(buffer)
        Reads.sizes.append(count)
        return count

    def close(self) -> None:
        self.file.close()
        super().close()


def test_a_parquet_source_is_converted_one_row_group_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow's pre-buffering, on by default, reads many row groups in one go: the first start's memory then grows
    with the file's rows. No read of the conversion may span more than one row group."""
    images = [{"bytes": random.Random(i).randbytes(5_000), "path": None} for i in range(400)]
    pq.write_table(
        pa.table({"id": [str(i) for i in range(400)], "image": images}), tmp_path / "t.parquet", row_group_size=20
    )
    metadata = pq.read_metadata(tmp_path / "t.parquet")
    groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
    largest = max(sum(group.column(c).total_compressed_size for c in range(group.num_columns)) for group in groups)
    module = sys.modules[
        type(datasets.load_dataset_builder("parquet", data_files=str(tmp_path / "t.parquet"))).__module__
    ]
    monkeypatch.setattr(module, "open", Reads, raising=False)
    Reads.sizes = []
    rows = prepared.read_parquet([tmp_path / "t.parquet"])
    assert len(rows) == 400 and Reads.sizes, "the conversion read nothing through the builder's open"
    assert max(Reads.sizes) <= largest, f"a read of {max(Reads.sizes)} bytes: more than a row group ({largest})"
