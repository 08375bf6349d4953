"""The multimodal collator: the one place where a raw example becomes a row the trainers and the evaluator consume:
its conversational prompt with image slots (`build_messages`) and its normalised images (`normalize_image`). It does
not batch: TRL's trainers (and the evaluator) tokenise, pad and stack pixels through the model's processor.

Every task builds its rows with `make_example`, so training (`recipes/train.py`, `recipes/sft.py`) and evaluation
(`eval/evaluate.py`) see the same prompt text, the same image positions and the same pixels: the most common
failure in this field is a train/eval mismatch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from typing import Any, Literal

import datasets
import numpy as np
from PIL import Image, ImageOps

from vision_grpo.data.encoded_images import CHECKED_FORMATS, encoded_bytes, integrity_problem, upright_size

ImagePosition = Literal["before_text", "after_text"]
IMAGE_SLOT = "<image>"  # where an image goes inside a task's prompt text

# The `prompt` column's features: conversational messages whose content parts are text or an image slot.
PROMPT_FEATURE = [
    {
        "role": datasets.Value("string"),
        "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}],
    }
]
WRITER_BATCH = 100  # rows a task's `Dataset.map` holds in memory while writing: decoded 256px images are ~200 kB each

# Anything larger than this is refused before decoding, so a hostile or broken file cannot exhaust memory.
MAX_DECODE_PIXELS = 64_000_000


class ImageTooLarge(ValueError):
    """An image over `MAX_DECODE_PIXELS`, caught from its header (its size) before its pixels are decoded."""


# Qwen-VL's image processors refuse an image whose long side is more than 200 times its short side (`smart_resize`).
MAX_ASPECT_RATIO = 200
# Qwen's control and vision tokens all look like this; inside a question they would be read as the real token.
SPECIAL_TOKEN = re.compile(r"<\|[a-z_]+\|>")


class RowRefused(ValueError):
    """A row the processor would refuse or the tokenizer misread later (at a training step or evaluation batch)."""


def check_aspect_ratio(size: tuple[int, int]) -> None:
    """Refuse an image of `size` (width, height) whose sides differ by more than `MAX_ASPECT_RATIO` times, before
    the processor does."""
    width, height = size
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise RowRefused(
            f"image of {width}x{height} pixels has an aspect ratio above {MAX_ASPECT_RATIO}, which Qwen-VL's "
            "processor refuses; crop or pad it"
        )


def special_token_in(text: str) -> str | None:
    """The first Qwen special token (`<|im_end|>`, `<|image_pad|>`, ...) written inside `text`, if any."""
    found = SPECIAL_TOKEN.search(text)
    return found.group(0) if found else None


def check_decode_size(image: Image.Image) -> None:
    """Refuse an image whose header announces more than `MAX_DECODE_PIXELS` pixels; call before decoding it."""
    width, height = image.size
    if width * height > MAX_DECODE_PIXELS:
        raise ImageTooLarge(
            f"image of {width}x{height} pixels is larger than the {MAX_DECODE_PIXELS:,}-pixel limit; "
            "shrink it before training"
        )


def build_messages(text: str, image_position: ImagePosition, images: int = 1) -> list[dict[str, Any]]:
    """One user message holding the question text and its image slots; no system prompt.

    Each `<image>` in `text` is where one image goes, in order; without any, the images go before or after the text
    (the task's `image_position`). The image parts are placeholders: TRL's GRPOTrainer and SFTTrainer (and our
    evaluator) fill them from the example's `image` (or `images`) column, so an image is stored once, not inside the
    prompt.
    """
    image_part = {"type": "image"}
    if IMAGE_SLOT in text:
        pieces = text.split(IMAGE_SLOT)
        if len(pieces) - 1 != images:
            raise ValueError(f"the text has {len(pieces) - 1} {IMAGE_SLOT} slots for {images} image(s)")
        content: list[dict[str, Any]] = []
        for index, piece in enumerate(pieces):
            if index:
                content.append(dict(image_part))
            if piece:
                content.append({"type": "text", "text": piece})
        return [{"role": "user", "content": content}]
    text_part = {"type": "text", "text": text}
    slots = [dict(image_part) for _ in range(images)]
    content = [*slots, text_part] if image_position == "before_text" else [text_part, *slots]
    return [{"role": "user", "content": content}]


def fill_image(prompt: list[dict], image: Any) -> list[dict]:
    """The prompt with its image placeholders holding the row's `image`, or its list of images one slot each in order
    (how TRL and the evaluator feed the processor)."""
    images = iter(image if isinstance(image, list) else [image])
    filled = []
    for message in prompt:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "image": next(images)}
                if part["type"] == "image"
                else {"type": "text", "text": part["text"]}
                for part in content
            ]
        filled.append({"role": message["role"], "content": content})
    return filled


def _to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode to RGB: transparency composited onto white, 16/32-bit greyscale scaled rather than clipped."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        array = np.asarray(image, dtype=np.float64)
        # 16-bit images have a known range (mid-grey stays mid-grey); 32-bit and float ones do not: peak is white.
        peak = 65535.0 if image.mode.startswith("I;16") else (array.max() if array.size and array.max() > 0 else 1.0)
        image = Image.fromarray(np.clip(array / peak * 255.0, 0, 255).astype(np.uint8), mode="L")
    if image.mode == "La":  # Pillow converts premultiplied LA to nothing but LA
        image = image.convert("LA")
    # A `transparency` entry (PNG tRNS) makes one colour of a P, L, RGB or 1-bit image transparent.
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa") or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def capped_size(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """The size `normalize_image` gives an upright image of `width` x `height`: itself within `max_pixels`, else
    shrunk to fit with its aspect ratio kept. The one place this arithmetic lives, so that the checking pass (which
    asks for the size without resizing) and the rows training reads cannot disagree."""
    if width * height <= max_pixels:
        return width, height
    factor = math.sqrt(max_pixels / (width * height))
    new_width, new_height = max(1, math.floor(width * factor)), max(1, math.floor(height * factor))
    # A side clamped to 1 pixel (extreme aspect ratios) leaves the other side to respect the limit alone.
    if new_width * new_height > max_pixels:
        if new_width > new_height:
            new_width = max_pixels // new_height
        else:
            new_height = max_pixels // new_width
    return new_width, new_height


def _upright_rgb(image: Image.Image) -> Image.Image:
    """The image decoded (its header's size checked first), EXIF orientation applied, converted to RGB on white."""
    check_decode_size(image)
    return _to_rgb(ImageOps.exif_transpose(image))


def normalize_image(image: Image.Image, max_pixels: int) -> Image.Image:
    """EXIF orientation applied, any mode to RGB on white, and at most `max_pixels` pixels (aspect kept).

    The processor resizes again to its patch grid; shrinking here first keeps huge inputs from costing memory and
    makes the number of image tokens depend only on what this function returns.
    """
    image = _upright_rgb(image)
    size = capped_size(image.width, image.height, max_pixels)
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


def normalized_size(
    image: Image.Image, max_pixels: int, decode: bool = True, verify_bitstream: Collection[str] = ()
) -> tuple[int, int]:
    """The size `normalize_image(image, max_pixels)` returns, without its resize: a checking pass needs the size
    training will see, and resizing a megapixel image costs several times decoding it.

    With `decode`, every way `normalize_image` can fail is met here (the decode-size limit, a file that does not
    decode, a mode that does not convert). Without it, a JPEG, PNG or WebP is not decoded: its size, orientation and
    integrity come from its container (data/encoded_images.py, a fraction of a millisecond against 10-60 ms a
    megapixel), so a truncated or damaged container fails here, a bitstream damaged inside whole chunks only when the
    row is read; the modes these formats hold all convert to RGB. Other formats are decoded either way.

    `verify_bitstream` names the formats (Pillow's: "JPEG", "WEBP") whose bitstream is decoded here although the
    container passed, for the pass under `skip_bad_rows` where a row found bad at access is not skipped there: a
    JPEG at an eighth of its size (libjpeg still reads every coefficient, so it fails as a full decode would: 1.2 ms
    against 4.5 ms at 1.2 MP), a WebP whole (22 ms at 1.2 MP). A PNG's CRCs cover every byte of it."""
    if not decode and image.format in CHECKED_FORMATS:
        check_decode_size(image)
        with encoded_bytes(image) as data:
            problem = integrity_problem(image, data) if data is not None else None
            size = upright_size(image, data) if data is not None and not problem else None
        if problem:
            raise OSError(problem)
        if image.format in verify_bitstream:
            image.draft("RGB", (image.width // 8, image.height // 8))  # JPEG only; WebP decodes whole
            image.load()
        if size is not None:
            return capped_size(*size, max_pixels)
    upright = _upright_rgb(image)
    return capped_size(upright.width, upright.height, max_pixels)


def checked_prompt(
    example_id: str, text: str, sizes: list[tuple[int, int]], image_position: ImagePosition
) -> list[dict[str, Any]]:
    """The prompt of a row whose normalised images have `sizes`, once the row passes what the processor and the
    tokenizer would refuse later (an aspect ratio, a special token in the text, slots that do not match the images);
    a refusal names the example."""
    try:
        for size in sizes:
            check_aspect_ratio(size)
        token = special_token_in(text.replace(IMAGE_SLOT, ""))
        if token:
            raise RowRefused(f"its text holds the special token {token}, which the tokenizer would read as control")
        return build_messages(text, image_position, len(sizes))
    except ValueError as error:
        raise RowRefused(f"example {example_id}: {error}") from None


def make_example(
    example_id: str,
    text: str,
    image: Image.Image | list[Image.Image],
    image_position: ImagePosition,
    max_pixels: int,
    **reward_columns: Any,
) -> dict[str, Any]:
    """A row for TRL's trainers and for our evaluator: `id`, conversational `prompt`, the normalised `image` (a list
    of images: `images`, one slot each), and the columns the reward functions read (TRL passes every extra column to
    them as a keyword list).

    A row the model would choke on later (an image the processor refuses, a special token typed into the text) fails
    here, naming its id, rather than at the training step or evaluation batch that meets it on every resume.
    """
    several = isinstance(image, list)
    images = [normalize_image(each, max_pixels) for each in (image if several else [image])]
    prompt = checked_prompt(example_id, text, [each.size for each in images], image_position)
    pixels = {"images": images} if several else {"image": images[0]}
    return {"id": example_id, "prompt": prompt, **pixels, **reward_columns}
