"""Neither the checking pass nor a pass of the evaluator over a split keeps the source resident: `datasets` reads
the source's Arrow file through a memory map, and every page read used to stay in the process's RSS (a 20,000-row
1-MP first start peaked about the source's size above a 1,000-row one). The pass releases the source's pages every
`RELEASE_EVERY` rows and at its end, the evaluator's `rows_at` after each batch, and every other read (the training
data loader's) every `RELEASE_EVERY` rows; measured here on the mapping itself
(/proc/self/smaps), sampled while the pass runs."""

from __future__ import annotations

import io
import random
import sys
import threading
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset, prepared, reading
from vision_grpo.evaluation.batches import chunks, read_batch
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

ROWS = 1000
SIDE = 120  # noise PNG: ≈43 KB a row, ≈43 MB of images in all, ten releases' worth of rows

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def noise_source(folder: Path) -> Path:
    """`folder/train.parquet`: `ROWS` rows of a distinct noise PNG each (incompressible, so the bytes are the
    file), a counting question and its answer, in row groups of 100 rows."""
    folder.mkdir(parents=True)

    def rows():
        for index in range(ROWS):
            pixels = random.Random(index).randbytes(SIDE * SIDE * 3)
            buffer = io.BytesIO()
            Image.frombytes("RGB", (SIDE, SIDE), pixels).save(buffer, format="PNG")
            yield {"id": str(index), "image": {"bytes": buffer.getvalue()}, "question": "How many?", "answer": "3"}

    text = datasets.Value("string")
    features = datasets.Features({"id": text, "image": datasets.Image(), "question": text, "answer": text})
    built = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(folder / "building"))
    built.to_parquet(str(folder / "train.parquet"), batch_size=100)
    return folder / "train.parquet"


def resident_kib(files: set[str]) -> int:
    """This process's resident KiB of its mappings of `files`, from /proc/self/smaps."""
    total, counting = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:  # a mapping's header line
            counting = len(fields) == 6 and fields[5] in files
        elif counting and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def noise_rows(tmp_path: Path) -> tuple[TaskArguments, set[str], int]:
    """The recipe's task arguments for a noise source, the paths of `datasets`' Arrow cache of it (the file the
    data path maps) and that file's KiB."""
    source = noise_source(tmp_path / "data")
    keys = ["--task", "vqa", "--dataset_name", str(source), "--vqa_image_column", "image", "--vqa_image_folder",
            "null", "--vqa_id_column", "id", "--vqa_answer_type", "number", "--use_cpu", "true"]  # fmt: skip
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), keys)[0]
    arrow = prepared.read_parquet([source])
    files = {str(Path(entry["filename"]).resolve()) for entry in arrow.cache_files}
    size_kib = sum(Path(file).stat().st_size for file in files) // 1024
    assert size_kib > 30_000, size_kib
    return args, files, size_kib


def test_the_pass_does_not_keep_its_source_resident(tmp_path: Path) -> None:
    args, files, size_kib = noise_rows(tmp_path)

    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_kib(files))
            done.wait(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        rows = get_dataset(args, "train", 168 * 168)
    finally:
        done.set()
        sampler.join()
    assert len(rows) == ROWS
    after = resident_kib(files)
    # Before the fix the pass left every image it decoded mapped: after ≈ size_kib, and the peak the same.
    assert after < size_kib * 0.1, (after, size_kib)
    assert 0 < peak[0] < size_kib * 0.5, (peak[0], size_kib)
    assert rows[ROWS - 1]["image"].size == (SIDE, SIDE)  # the images still read from the released pages


def test_an_evaluation_pass_over_a_split_does_not_keep_it_resident(tmp_path: Path) -> None:
    args, files, size_kib = noise_rows(tmp_path)
    rows = get_dataset(args, "train", 168 * 168)
    shown = 0
    for indices in chunks(range(len(rows)), 32):
        _, images = read_batch(rows, indices)
        shown += len(images)
    assert shown == ROWS
    after = resident_kib(files)
    # Before `rows_at` released them, every image read stayed mapped: after ≈ size_kib.
    assert after < size_kib * 0.1, (after, size_kib)


def test_a_training_loader_reading_every_row_does_not_keep_them_resident(tmp_path: Path) -> None:
    args, files, size_kib = noise_rows(tmp_path)
    rows = get_dataset(args, "train", 168 * 168)
    # As the trainer's loader reads (GRPO's collator is the identity): batches of rows through `__getitems__`. In
    # order: a shuffled read of one of this file's rows faults in ~370 kB around it here (8 MB read-ahead), so 100
    # shuffled rows map most of this 43-MB file between two releases; the bound that holds at any size, measured
    # by `benchmarks/data_scale.py --train-rows`, is those 100 rows' worth, not the file.
    loader = torch.utils.data.DataLoader(rows, batch_size=8, collate_fn=list)
    read = sum(len(batch) for batch in loader)
    assert read == ROWS
    after = resident_kib(files)
    # Before the loader's reads released them every `RELEASE_EVERY` rows, every image read stayed mapped.
    assert after < size_kib * (2 * reading.RELEASE_EVERY / ROWS), (after, size_kib)
