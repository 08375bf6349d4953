"""The checking pass does not keep its source resident: `datasets` reads the source's Arrow file through a memory
map, and every page the pass touched used to stay in the process's RSS (a 20,000-row 1-MP first start peaked about
the source's size above a 1,000-row one). The pass now releases the source's pages every `RELEASE_EVERY` rows and
at its end; measured here on the mapping itself (/proc/self/smaps), sampled while the pass runs."""

from __future__ import annotations

import io
import random
import sys
import threading
from pathlib import Path

import datasets
import pytest
from PIL import Image
from trl import GRPOConfig, ModelConfig

from vision_grpo.config import TaskArguments, parse_recipe
from vision_grpo.data import get_dataset, prepared

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


def test_the_pass_does_not_keep_its_source_resident(tmp_path: Path) -> None:
    source = noise_source(tmp_path / "data")
    keys = ["--task", "vqa", "--dataset_name", str(source), "--vqa_image_column", "image", "--vqa_image_folder",
            "null", "--vqa_id_column", "id", "--vqa_answer_type", "number", "--use_cpu", "true"]  # fmt: skip
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), keys)[0]
    arrow = prepared.read_parquet([source])  # `datasets`' Arrow cache of the source: the file the pass maps
    files = {str(Path(entry["filename"]).resolve()) for entry in arrow.cache_files}
    size_kib = sum(Path(file).stat().st_size for file in files) // 1024
    assert size_kib > 30_000, size_kib

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
