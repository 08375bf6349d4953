"""The recipe's pixel limits reach the image processor through the supported interface (its `size` edges) and give
every family the image-token counts the deprecated per-call `min_pixels`/`max_pixels` keywords gave.

EXPECTED was measured on 2026-12-03 (transformers 5.24) with the old call, `image_processor(images=...,
min_pixels=..., max_pixels=...)` on each replica's processor, and agrees with Qwen2-VL's documented `smart_resize`
rule worked by hand (sides rounded to the 28- or 32-pixel cell, scaled into the limits): numbers written down, not
computed by the code under test.
"""

from __future__ import annotations

import pytest
from conftest import FAMILY_MODELS
from PIL import Image
from trl import ModelConfig

from vision_grpo.models.loading import get_processor
from vision_grpo.recipe.arguments import TaskArguments

SIZES = [(20, 20), (64, 64), (100, 60), (200, 150), (640, 480), (300, 40)]  # width x height
# (min_pixels, max_pixels) of a recipe; (None, None) keeps the replica's own (2x2 to 6x6 cells).
LIMITS = [(None, None), (3136, 50176), (40000, 50176)]
CELL_28 = {  # Qwen2.5-VL: 14-pixel patches merged 2x2
    (None, None): [4, 4, 8, 35, 30, 11],
    (3136, 50176): [4, 4, 8, 35, 54, 11],
    (40000, 50176): [64, 64, 60, 63, 54, 60],
}
CELL_32 = {  # Qwen3-VL and Qwen3.5: 16-pixel patches merged 2x2
    (None, None): [4, 4, 6, 30, 30, 9],
    (3136, 50176): [4, 4, 6, 30, 48, 9],
    (40000, 50176): [49, 49, 45, 48, 48, 54],
}
EXPECTED = dict(zip(FAMILY_MODELS, (CELL_28, CELL_32, CELL_32), strict=True))
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]


def image_tokens(processor, size: tuple[int, int]) -> int:
    """Image tokens in the prompt the processor renders for one image of `size`, as training renders it."""
    text = processor.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    rendered = processor(text=[text], images=[Image.new("RGB", size, "white")], return_tensors="pt")
    image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return int((rendered["input_ids"] == image_token_id).sum())


@pytest.mark.parametrize("limits", LIMITS, ids=lambda limits: f"{limits[0]}-{limits[1]}")
@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_pixel_limits_give_the_image_tokens_of_the_deprecated_call(name: str, limits: tuple) -> None:
    min_pixels, max_pixels = limits
    processor = get_processor(
        ModelConfig(model_name_or_path=name), TaskArguments(min_pixels=min_pixels, max_pixels=max_pixels)
    )
    assert [image_tokens(processor, size) for size in SIZES] == EXPECTED[name][limits]
