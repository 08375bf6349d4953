"""Every task's rows and prompts, byte for byte, as consumers read them (`dataset[i]`): digests recorded from the
data path before it was made lazy, so a change to how rows are prepared, cached or decoded cannot change what the
model sees. The image digest is of the decoded pixels (mode, size, bytes), the rest of the row's JSON.

    python tests/test_data_digests.py   # prints the digests of the current code
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.geoqa_fixture import write_fixture
from vision_grpo.data.vqa_fixtures import write_fixtures
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

MAX_PIXELS = 168 * 168
CASES = {
    "shapes": ["--config", "recipes/shapes/tiny_cpu.yaml"],
    "shapes_single": ["--config", "recipes/shapes/tiny_grpo_demo.yaml"],
    "geoqa": ["--config", "recipes/geoqa/tiny_cpu.yaml", "--dataset_name", "{root}/geoqa.parquet"],
    "vqa_geometry3k": ["--config", "recipes/vqa/tiny_geometry3k.yaml", "--dataset_name", "{root}/vqa/geometry3k"],
    "vqa_clevr": [
        "--config",
        "recipes/vqa/tiny_clevr_count.yaml",
        "--dataset_name",
        "{root}/vqa/clevr_count",
        "--vqa_image_folder",
        "{root}/vqa/clevr_count/images",
    ],
    "vqa_two_image": ["--config", "recipes/vqa/tiny_two_image.yaml", "--dataset_name", "{root}/vqa/two_image"],
}
# Columns added since the recording (a choice row's number of options), left out of the digest; every other column
# must be as recorded.
ADDED = {"options"}
# Recorded on the data path before it was made lazy (commit 1927d08).
DIGESTS: dict[str, dict[str, str]] = {
    "shapes": {
        "train": "4033e4818a044e0ee84688531080ea2964031996c60af5f4767f6b1574b8cde4",
        "eval": "2a513764848b6a75464d5032ad1f9627168e8772578d8ab91d51e6af2b322091",
    },
    "shapes_single": {
        "train": "12bc1f728bc8874e673dd45d55c8a19e82b018bfdb2e8f1e0c275ed582f998b5",
        "eval": "8460d91fbaed442afd6918cece75633ac6be15edf8b4cc9d7647f54a357c36eb",
    },
    "geoqa": {
        "train": "a47902b15e8f01e2041d7eb48cdd6673f0bcb8de7592ab26e74e85e1836e7fe7",
        "eval": "c2d4624fc9e38b57b715f5df824e91d490799d822537b6ac454c944cb1fe4877",
    },
    "vqa_geometry3k": {
        "train": "d6ed971c88692e9e41a11093be6f2da6cd4e65c0f12dbcf21bd34755ae9f2b0f",
        "eval": "337c33f83838269d4dd2de0b391686fb7f34494a36aa0353273d149f904e1ae4",
    },
    "vqa_clevr": {
        "train": "0c5cdde6c5fc07c6eca82d5c055bf8e792557d973f37e7068f62c1f0daa54c13",
        "eval": "22ad79a3a2823e89ec825abb12e6fc9f5b8f4dc2aa820e1d77930942ebdd7c8e",
    },
    "vqa_two_image": {
        "train": "b2e3a612dfa6ef57af07c4d962a1de77e49b8324c985ac8e61b94f69b124a4e0",
        "eval": "ff7ec9c43be3049ed5a887d95d47ece12f3da4489c66a5a8abdfa50932d2afa4",
    },
}


def _value(value: Any) -> Any:
    if isinstance(value, Image.Image):
        return {"mode": value.mode, "size": value.size, "pixels": hashlib.sha256(value.tobytes()).hexdigest()}
    if isinstance(value, list):
        return [_value(each) for each in value]
    if isinstance(value, dict):
        return {key: _value(each) for key, each in sorted(value.items())}
    return value


def digest(dataset: Any) -> str:
    """One sha256 over every row in order, every column, images as decoded pixels."""
    total = hashlib.sha256()
    for index in range(len(dataset)):
        row = {key: value for key, value in dataset[index].items() if key not in ADDED}
        total.update(json.dumps(_value(row), sort_keys=True, ensure_ascii=False).encode())
    total.update(str(len(dataset)).encode())
    return total.hexdigest()


def write_sources(root: Path) -> Path:
    write_fixture(root / "geoqa.parquet")
    write_fixtures(root / "vqa")
    return root


def digests(case: str, root: Path) -> dict[str, str]:
    argv = [arg.format(root=root) for arg in CASES[case]] + ["--use_cpu", "true"]
    task_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]
    return {split: digest(get_dataset(task_args, split, MAX_PIXELS)) for split in ("train", "eval")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    return write_sources(tmp_path_factory.mktemp("digests"))


@pytest.mark.parametrize("case", list(CASES))
def test_rows_and_prompts_are_byte_identical_to_the_recorded_ones(case: str, sources: Path) -> None:
    assert digests(case, sources) == DIGESTS[case]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        root = write_sources(Path(folder))
        json.dump({case: digests(case, root) for case in CASES}, sys.stdout, indent=4)
