"""Image normalisation: any input mode and orientation becomes an upright RGB image on white, within the pixel limit."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vision_grpo.data.prompts_and_images import MAX_DECODE_PIXELS, build_messages, make_example, normalize_image

LIMIT = 100 * 100
WHITE, BLACK, RED = (255, 255, 255), (0, 0, 0), (255, 0, 0)


def pixel(image: Image.Image, x: int, y: int) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(image)[y, x])


def reopened(image: Image.Image, **save_kwargs) -> Image.Image:
    """The image after a PNG round trip, as a loader would hand it over (keeps tRNS and eXIf)."""
    buffer = io.BytesIO()
    image.save(buffer, "PNG", **save_kwargs)
    buffer.seek(0)
    return Image.open(buffer)


def left_opaque_right_transparent(mode: str, opaque: int | tuple[int, ...]) -> Image.Image:
    """A 20x10 image of `mode`: left half `opaque`, right half fully transparent."""
    image = Image.new(mode, (20, 10), opaque)
    transparent = (0,) * len(image.getbands())
    image.paste(transparent, (10, 0, 20, 10))
    return image


def palette_with_transparency() -> Image.Image:
    """A P image, index 0 transparent (black in the palette), index 1 red; left half red."""
    image = Image.new("P", (20, 10), 0)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.paste(1, (0, 0, 10, 10))
    image.info["transparency"] = 0
    return reopened(image, transparency=0)


def grey16(value: int) -> Image.Image:
    return Image.fromarray(np.full((10, 20), value, dtype=np.uint16))


CASES = {
    "RGBA": (lambda: left_opaque_right_transparent("RGBA", (255, 0, 0, 255)), RED, WHITE),
    "LA": (lambda: left_opaque_right_transparent("LA", (0, 255)), BLACK, WHITE),
    "P+transparency": (palette_with_transparency, RED, WHITE),
    "L": (lambda: Image.new("L", (20, 10), 128), (128, 128, 128), (128, 128, 128)),
    "CMYK": (lambda: Image.new("CMYK", (20, 10), (0, 255, 255, 0)), RED, RED),
    "I;16 mid-grey": (lambda: grey16(32768), (127, 127, 127), (127, 127, 127)),
    "I;16 black": (lambda: grey16(0), BLACK, BLACK),
    "1-bit": (lambda: Image.new("1", (20, 10), 1), WHITE, WHITE),
}


@pytest.mark.parametrize("case", CASES)
def test_modes_become_rgb_with_transparency_on_white(case: str) -> None:
    make, left, right = CASES[case]
    image = normalize_image(make(), LIMIT)
    assert image.mode == "RGB"
    assert image.size == (20, 10)
    assert pixel(image, 2, 5) == left
    assert pixel(image, 17, 5) == right


def test_a_transparent_colour_key_becomes_white() -> None:
    """PNG's tRNS chunk makes one colour of an L or RGB image transparent: that colour must become white."""
    grey = Image.new("L", (20, 10), 50)
    grey.paste(0, (10, 0, 20, 10))
    image = normalize_image(reopened(grey, transparency=0), LIMIT)
    assert pixel(image, 2, 5) == (50, 50, 50)
    assert pixel(image, 17, 5) == WHITE
    rgb = Image.new("RGB", (20, 10), RED)
    rgb.paste((0, 0, 0), (10, 0, 20, 10))
    image = normalize_image(reopened(rgb, transparency=(0, 0, 0)), LIMIT)
    assert (pixel(image, 2, 5), pixel(image, 17, 5)) == (RED, WHITE)


def test_exif_rotation_is_applied() -> None:
    """Stored 40x20 with a red left half and orientation 6 (rotate 90 degrees clockwise to display)."""
    stored = Image.new("RGB", (40, 20), (0, 0, 255))
    stored.paste(RED, (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    image = normalize_image(reopened(stored, exif=exif), LIMIT)
    assert image.size == (20, 40)
    assert pixel(image, 10, 5) == RED  # the stored left half is on top once upright
    assert pixel(image, 10, 35) == (0, 0, 255)


def test_huge_images_are_shrunk_with_their_aspect_ratio() -> None:
    image = normalize_image(Image.new("RGB", (4000, 3000), RED), LIMIT)
    assert image.width * image.height <= LIMIT
    assert image.width * image.height > 0.95 * LIMIT
    assert abs(image.width / image.height - 4 / 3) < 0.02
    assert pixel(image, 0, 0) == RED


@pytest.mark.parametrize("size", [(100_000, 1), (3, 40_000)])
def test_extreme_aspect_ratios_stay_within_the_limit(size: tuple[int, int]) -> None:
    image = normalize_image(Image.new("RGB", size), LIMIT)
    assert image.width * image.height <= LIMIT
    assert min(image.size) >= 1


def test_small_images_keep_their_size() -> None:
    assert normalize_image(Image.new("RGB", (30, 7)), LIMIT).size == (30, 7)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` but holds no pixel data: opening it must not decode anything."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    ihdr = struct.pack(">I", len(header)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    end = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    return b"\x89PNG\r\n\x1a\n" + ihdr + end


def test_an_image_above_the_decode_limit_is_refused_before_decoding() -> None:
    width = height = int(MAX_DECODE_PIXELS**0.5) + 100  # below Pillow's own bomb limit, above ours
    image = Image.open(io.BytesIO(png_header_only(width, height)))
    with pytest.raises(ValueError, match="pixel limit"):
        normalize_image(image, LIMIT)


def test_make_example_normalises_the_image_and_keeps_reward_columns() -> None:
    row = make_example("x-1", "How many circles?", Image.new("RGBA", (300, 300)), "before_text", LIMIT, answer=3)
    assert row["prompt"] == build_messages("How many circles?", "before_text")
    assert [part["type"] for part in row["prompt"][0]["content"]] == ["image", "text"]
    assert row["image"].mode == "RGB"
    assert row["image"].width * row["image"].height <= LIMIT
    assert row["answer"] == 3
    assert [p["type"] for p in build_messages("q", "after_text")[0]["content"]] == ["text", "image"]


MODES = ["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"]
MODES += ["I", "F", "I;16", "I;16L", "I;16B", "I;16N"]


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    width=st.integers(1, 1500),
    height=st.integers(1, 1500),
    max_pixels=st.integers(1, 200_000),
    transparency=st.booleans(),
)
def test_any_mode_and_size_becomes_rgb_within_the_limit(
    mode: str, width: int, height: int, max_pixels: int, transparency: bool
) -> None:
    image = Image.new(mode, (width, height))
    if transparency and mode in ("P", "L", "RGB", "1"):
        image.info["transparency"] = 0 if mode != "RGB" else (0, 0, 0)
    out = normalize_image(image, max_pixels)
    assert out.mode == "RGB"
    assert min(out.size) >= 1
    assert out.width * out.height <= max_pixels
    if width * height <= max_pixels:
        assert out.size == (width, height)
