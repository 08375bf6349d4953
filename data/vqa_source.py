"""Reading a VQA source for the generic VQA task (data/task_vqa.py): its rows from the Hub, a `save_to_disk`
folder, a folder of `<split>.parquet` / `<split>.jsonl` files or a path with `{split}` in it, and a row's images from
PIL images, encoded bytes or paths inside `vqa_image_folder`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import datasets
from PIL import Image

from vision_grpo.data import hub, prepared


class VQADataError(ValueError):
    """A VQA source or row that cannot be used as configured."""


def read_source(source: str, revision: str | None, split: str) -> datasets.Dataset:
    """The rows of `split` of `source` (see the module's docstring for the forms a source takes)."""
    path = Path(source.replace("{split}", split)).expanduser()
    if "{split}" in source or path.is_file():
        return _read_file(path)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            loaded = datasets.load_from_disk(str(path))
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        for suffix in (".parquet", ".jsonl"):
            if (path / f"{split}{suffix}").is_file():
                return _read_file(path / f"{split}{suffix}")
        raise VQADataError(f"{source}: no {split}.parquet or {split}.jsonl and not a save_to_disk folder")
    if source.startswith((".", "/", "~")):
        raise VQADataError(f"{source} does not exist")
    return hub.load(source, revision, split)


def _read_file(path: Path) -> datasets.Dataset:
    if not path.is_file():
        raise VQADataError(f"{path} does not exist")
    kinds = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
    if path.suffix not in kinds:
        raise VQADataError(f"{path}: not a .parquet or .jsonl file")
    # JSON must be UTF-8; Arrow's reader would pass invalid bytes on, to fail later without naming file or line.
    line = _first_non_utf8_line(path) if kinds[path.suffix] == "json" else None
    if line is not None:
        raise VQADataError(f"{path}: line {line} is not valid UTF-8; re-encode the file as UTF-8")
    if kinds[path.suffix] == "parquet":
        return prepared.read_parquet([path])
    return datasets.load_dataset(kinds[path.suffix], data_files=str(path), split="train")


def _first_non_utf8_line(path: Path) -> int | None:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return None


def _image_path(value: str, folder: str | None) -> Path:
    """`value` inside `vqa_image_folder` (the working directory when unset); a path that leaves it is refused."""
    root = Path(folder or ".").expanduser().resolve()
    path = (root / value).resolve()
    if not path.is_relative_to(root):
        raise VQADataError(
            f"image path {value!r} is outside vqa_image_folder ({root}); image paths must stay inside it "
            "(set vqa_image_folder to the folder that holds the images)"
        )
    if not path.is_file():
        raise VQADataError(f"image file {path} does not exist")
    return path


def _open_image(value: Any, folder: str | None) -> Image.Image:
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        if value.get("bytes"):
            return Image.open(io.BytesIO(value["bytes"]))
        value = value["path"]
    if isinstance(value, str) and value:
        return Image.open(_image_path(value, folder))
    raise VQADataError(f"no image (got {type(value).__name__})")


def open_images(value: Any, folder: str | None) -> list[Image.Image]:
    """The row's images, opened; a row without one (null, an empty list, a null in the list) is refused: the task
    trains and evaluates images, and a text-only row would fail in the processor at its first step."""
    if isinstance(value, list) and not value:
        raise VQADataError("no image (an empty image list)")
    if isinstance(value, list) and None in value:
        raise VQADataError(f"no image at position {value.index(None) + 1} of its {len(value)} (null)")
    return [_open_image(each, folder) for each in (value if isinstance(value, list) else [value])]
