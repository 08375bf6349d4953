"""The checking pass sees the size training will see without resizing to it: `normalized_size` is exactly the size
`normalize_image` returns (any mode, size, limit and EXIF orientation), the VQA pass resizes nothing yet still
decodes every image (a truncated file is refused, naming its row), and the rows read afterwards are resized."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.prompts_and_images import normalize_image, normalized_size
from vision_grpo.data.task_vqa import VQADataError
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

MAX_PIXELS = 100 * 100
ORIENTATION = 0x0112  # the EXIF tag
MODES = ["1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "I", "I;16", "F"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def opened(mode: str, size: tuple[int, int], orientation: int) -> Image.Image:
    """A new image of `mode` as a loader hands it over: undecoded, from a file whose EXIF orientation is
    `orientation` (5-8 swap width and height once upright). PNG for the modes it holds; TIFF (whose reader applies
    the orientation itself) for the others."""
    buffer = io.BytesIO()
    if mode in ("CMYK", "YCbCr", "LAB", "I", "F"):
        Image.new(mode, size).save(buffer, "TIFF", tiffinfo={ORIENTATION: orientation})
    else:
        exif = Image.Exif()
        exif[ORIENTATION] = orientation
        Image.new(mode, size).save(buffer, "PNG", exif=exif)
    buffer.seek(0)
    return Image.open(buffer)


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    width=st.integers(1, 900),
    height=st.integers(1, 900),
    max_pixels=st.integers(1, 60_000),
    orientation=st.integers(1, 8),
)
def test_normalized_size_is_the_size_normalize_image_returns(
    mode: str, width: int, height: int, max_pixels: int, orientation: int
) -> None:
    expected = normalize_image(opened(mode, (width, height), orientation), max_pixels).size
    assert normalized_size(opened(mode, (width, height), orientation), max_pixels) == expected


def jpeg(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.linear_gradient("L").resize((width, height)).convert("RGB").save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def vqa_args(folder: Path, rows: list[dict]) -> TaskArguments:
    features = datasets.Features(
        {"id": datasets.Value("string"), "image": datasets.Image(), "question": datasets.Value("string"),
         "answer": datasets.Value("string")}
    )  # fmt: skip
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(folder / "train.parquet"))
    argv = ["--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", "null", "--vqa_id_column", "id",
            "--vqa_answer_type", "number", "--use_cpu", "true"]  # fmt: skip
    return parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]


def row(row_id: str, data: bytes) -> dict:
    return {"id": row_id, "image": {"bytes": data, "path": None}, "question": "How many?", "answer": "2"}


def test_the_pass_resizes_nothing_and_the_rows_read_are_resized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = vqa_args(tmp_path, [row("a", jpeg(400, 300)), row("b", jpeg(300, 400))])
    resizes = []
    resize = Image.Image.resize

    def counted(image: Image.Image, *args, **kwargs) -> Image.Image:
        resizes.append(image.size)
        return resize(image, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", counted)
    rows = get_dataset(args, "train", MAX_PIXELS)
    assert resizes == []  # the pass checked both 0.12-MP images against a 0.01-MP limit without resizing either
    assert [rows[i]["image"].size for i in range(2)] == [(115, 86), (86, 115)]
    assert resizes == [(400, 300), (300, 400)]


def test_a_truncated_image_is_still_refused_by_the_pass(tmp_path: Path) -> None:
    whole = jpeg(400, 300)
    args = vqa_args(tmp_path, [row("whole", whole), row("cut", whole[: len(whole) // 2])])
    with pytest.raises(VQADataError, match=r"VQA row id='cut': image file is truncated"):
        get_dataset(args, "train", MAX_PIXELS)
