"""What the checking pass can know of an encoded JPEG, PNG or WebP image without decoding its pixels.

Decoding a 1-MP photograph costs 10-60 ms (JPEG, WebP, PNG); the pass needs, per image, the size training will
see and whether the file is whole. Both come from the container here, for a fraction of a millisecond:

- the upright size: the header's width and height, swapped for EXIF orientations 5-8, exactly what
  `ImageOps.exif_transpose` does after decoding (for a PNG only when no metadata chunk follows its pixel data, where
  Pillow would look for the orientation after decoding; such a file is decoded instead);
- integrity, per format: JPEG, its marker segments in bounds up to the end-of-image marker (the one failure of a
  JPEG decode that Pillow raises for, truncation, is a missing end; corrupt entropy data only makes libjpeg warn);
  PNG, every chunk in bounds with its CRC-32 right, up to IEND (stricter than Pillow's decode, which skips the pixel
  chunks' CRCs; Pillow's `verify()` checks them too, but a PNG without pixel data fails there with an IndexError that
  names nothing, and the walk is needed anyway to find metadata after the pixels: tests/test_data_encoded_images.py
  shows both); WebP, the RIFF chunks in bounds and a VP8/VP8L bitstream present (a bitstream damaged inside whole
  chunks is found only by decoding: at access, or before training with `vqa_image_check: decode`).

Any other format is decoded by the pass, as before.
"""

from __future__ import annotations

import contextlib
import io
import re
import struct
import zlib
from collections.abc import Iterator
from typing import Any

from PIL import Image

CHECKED_FORMATS = ("JPEG", "PNG", "WEBP")
ORIENTATION = 0x0112  # the EXIF tag; 5-8 turn the image a quarter
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Where Pillow finds an orientation in a PNG once decoded: the eXIf chunk, or EXIF / XMP written as text.
PNG_METADATA = {b"eXIf", b"tEXt", b"zTXt", b"iTXt"}
# Inside a JPEG scan, 0xFF is followed by 0x00 (a stuffed byte) or a restart marker; anything else ends the scan.
JPEG_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
TRUNCATED = "image file is truncated"  # Pillow's own words for it, so that a reason reads the same either way


@contextlib.contextmanager
def encoded_bytes(image: Image.Image) -> Iterator[Any]:
    """A view of the file `image` was opened from, whole (None when Pillow holds no file for it). Read from memory,
    the view is of the bytes themselves: a 4-MP PNG is 8 MB, and copying it would cost as much as checking it."""
    handle = getattr(image, "fp", None)
    if handle is None:
        yield None
        return
    if isinstance(handle, io.BytesIO):
        data = handle.getvalue()  # the bytes it was made from, not a copy, while nothing wrote to it
    else:
        handle.seek(0)
        data = handle.read()
    with memoryview(data) as view:
        yield view


def integrity_problem(image: Image.Image, data: Any) -> str | None:
    """Why the encoded `data` (a memoryview) of `image` (a JPEG, PNG or WebP opened by Pillow) cannot be whole."""
    check = {"JPEG": _jpeg_problem, "PNG": _png_problem, "WEBP": _webp_problem}[image.format]
    return check(data)


def upright_size(image: Image.Image, data: Any) -> tuple[int, int] | None:
    """The size of `image` once `ImageOps.exif_transpose` has turned it, read from its header; None where only
    decoding tells (a PNG whose metadata chunks follow its pixel data)."""
    if image.format == "PNG":
        if _png_metadata_after_pixels(data):
            return None
        exif = Image.Image.getexif(image)  # the chunks before the pixels, as opened: PNG's own getexif decodes
    else:
        exif = image.getexif()
    width, height = image.size
    return (height, width) if exif.get(ORIENTATION, 1) in (5, 6, 7, 8) else (width, height)


def _jpeg_problem(data: Any) -> str | None:
    if bytes(data[:2]) != b"\xff\xd8":
        return "not a JPEG file (no start-of-image marker)"
    at, end = 2, len(data)
    while at + 2 <= end:
        if data[at] != 0xFF:
            return f"corrupt JPEG file (no marker at byte {at})"
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
            continue
        if marker == 0xD9:
            return None
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a segment
            at += 2
            continue
        if at + 4 > end:
            break
        length = (data[at + 2] << 8) | data[at + 3]
        if length < 2:
            return f"corrupt JPEG file (segment length {length} at byte {at})"
        at += 2 + length
        if at > end:
            break
        if marker == 0xDA:  # a scan: its entropy-coded data runs to the next marker
            found = JPEG_SCAN_END.search(data, at)
            if found is None:
                break
            at = found.start()
    return f"{TRUNCATED} (JPEG without its end-of-image marker)"


def _png_chunks(data: Any) -> Any:
    """(type, start, length) of each chunk; a chunk cut short ends the walk with type None."""
    at, end = len(PNG_SIGNATURE), len(data)
    while True:
        if at + 12 > end:
            yield None, at, 0
            return
        length, kind = struct.unpack_from(">I4s", data, at)
        if at + 12 + length > end:
            yield None, at, length
            return
        yield kind, at, length
        if kind == b"IEND":
            return
        at += 12 + length


def _png_problem(data: Any) -> str | None:
    if bytes(data[:8]) != PNG_SIGNATURE:
        return "not a PNG file (bad signature)"
    pixels = False
    for kind, at, length in _png_chunks(data):
        if kind is None:
            return f"{TRUNCATED} (PNG cut inside a chunk at byte {at})"
        if zlib.crc32(data[at + 4 : at + 8 + length]) != struct.unpack_from(">I", data, at + 8 + length)[0]:
            return f"corrupt PNG file (CRC mismatch in its {kind.decode('latin-1')} chunk at byte {at})"
        pixels = pixels or kind == b"IDAT"
        if kind == b"IEND":
            return None if pixels else "corrupt PNG file (no IDAT chunk)"
    return f"{TRUNCATED} (PNG without its IEND chunk)"


def _png_metadata_after_pixels(data: Any) -> bool:
    pixels = False
    for kind, _, _ in _png_chunks(data):
        pixels = pixels or kind == b"IDAT"
        if pixels and kind in PNG_METADATA:
            return True
    return False


def _webp_problem(data: Any) -> str | None:
    if bytes(data[:4]) != b"RIFF" or bytes(data[8:12]) != b"WEBP":
        return "not a WebP file (no RIFF WEBP header)"
    (size,) = struct.unpack_from("<I", data, 4)
    end = 8 + size
    if end > len(data):
        return f"{TRUNCATED} (WebP of {len(data)} bytes announces {end})"
    at, bitstream = 12, False
    while at + 8 <= end:
        kind = bytes(data[at : at + 4])
        (length,) = struct.unpack_from("<I", data, at + 4)
        if at + 8 + length > end:
            return f"{TRUNCATED} (WebP {kind.decode('latin-1')} chunk at byte {at} runs past the file)"
        bitstream = bitstream or kind in (b"VP8 ", b"VP8L", b"ANMF")
        at += 8 + length + (length & 1)
    return None if bitstream else "corrupt WebP file (no VP8/VP8L bitstream chunk)"
