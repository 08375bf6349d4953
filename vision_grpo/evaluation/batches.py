"""Reading the rows an evaluation generates for, one batch at a time: their images decoded now (never the whole
split), the source's mapped pages released after each batch, and the image controls (blank or another row's image).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PIL import Image

from vision_grpo.data.reading import release_mapped_pages


def images_of(row: dict[str, Any]) -> Any:
    """A row's image, or its list of images (the `images` column of multi-image tasks)."""
    return row["image"] if "image" in row else row["images"]


def chunks(indices: Sequence[int], size: int) -> list[list[int]]:
    """`indices` in consecutive batches of `size` (the last one shorter)."""
    return [list(indices[first : first + size]) for first in range(0, len(indices), size)]


def rows_at(dataset: Any, indices: Sequence[int]) -> list[dict[str, Any]]:
    """The rows of `dataset` at `indices`, read (their images decoded) now: one batch at a time, never the split.
    The pages of the source they were read from are released after each batch (`release_mapped_pages`), so that a
    pass over a split does not keep the whole split's images resident."""
    if not indices:
        return []
    columns = dataset[list(indices)]
    release_mapped_pages(dataset)
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def read_batch(dataset: Any, indices: Sequence[int], control: str = "none") -> tuple[list[dict], list[Any]]:
    """The rows at `indices` and the image(s) each is shown: its own, white canvases of the same sizes (`blank`), or
    the next row's in `dataset` (`shuffled`, the last row gets the first's). Built per batch, so the split's images
    are never all held at once."""
    rows = rows_at(dataset, indices)
    if control == "none":
        return rows, [images_of(row) for row in rows]
    if control == "blank":
        return rows, [_blank(images_of(row)) for row in rows]
    if control == "shuffled":
        return rows, [images_of(row) for row in rows_at(dataset, [(i + 1) % len(dataset) for i in indices])]
    raise ValueError(f"image control must be none, blank or shuffled, got {control!r}")


def _blank(image: Any) -> Any:
    if isinstance(image, list):
        return [_blank(each) for each in image]
    return Image.new("RGB", image.size, "white")
