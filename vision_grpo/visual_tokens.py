"""Before training: does what the processor makes of an image fit what the model will consume?

A processor from another family, a pixel limit that did not take effect, or a chat template that renders the image
slot twice (or not at all) all train without an error message on some paths and silently misalign image features on
others. `check_visual_tokens` renders sample prompts exactly as training does and checks them against the *model's*
config, not against the processor itself, naming the first row that fails.
"""

from __future__ import annotations

from typing import Any

import datasets
from tqdm.auto import tqdm

from vision_grpo.data.prompts_and_images import fill_image


class VisualTokenMismatch(ValueError):
    """A rendered prompt whose image tokens or pixels do not fit the model's vision tower."""


def _check_row(row_id: str, image: Any, rendered: Any, processor: Any, model_config: Any, limits: tuple) -> None:
    vision = model_config.vision_config
    grid = rendered["image_grid_thw"]
    images = image if isinstance(image, list) else [image]
    where = f"example {row_id} ({', '.join(f'{i.width}x{i.height}' for i in images)} image{'s' * (len(images) > 1)})"
    patch_dim = rendered["pixel_values"].shape[-1]
    expected_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    if patch_dim != expected_dim:
        processor_patch = processor.image_processor.patch_size
        raise VisualTokenMismatch(
            f"{where}: the processor cuts {processor_patch}-pixel patches ({patch_dim} values each) but the model's "
            f"vision tower takes {vision.patch_size}-pixel patches ({expected_dim} values); the processor belongs to "
            "another model family: load the checkpoint's own processor"
        )
    features = int(grid.prod(dim=-1).sum()) // vision.spatial_merge_size**2
    found = int((rendered["input_ids"] == model_config.image_token_id).sum())
    if found != features:
        raise VisualTokenMismatch(
            f"{where}: the prompt holds {found} image tokens (id {model_config.image_token_id}) but the vision tower "
            f"produces {features} features for this image (patch grid {grid.tolist()}, merge "
            f"{vision.spatial_merge_size}x{vision.spatial_merge_size}); check the chat template's image part and the "
            "processor's merge size"
        )
    # What an inference server (vLLM) computes from the image size alone must agree with the rendered prompt.
    sizes = [(each.height, each.width) for each in images]
    server = sum(processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"])
    if server != found:
        raise VisualTokenMismatch(
            f"{where}: the prompt holds {found} image tokens but the processor's pixel limits "
            f"{dict(processor.image_processor.size)} give {server}; set the limits through `min_pixels`/`max_pixels` "
            "in the recipe, not on the image processor's attributes"
        )
    min_pixels, max_pixels = limits
    for pixels in (int(h * w) * vision.patch_size**2 for _, h, w in grid.tolist()):
        if (min_pixels is None or pixels >= min_pixels) and (max_pixels is None or pixels <= max_pixels):
            continue
        raise VisualTokenMismatch(
            f"{where}: the model sees {pixels} pixels, outside the recipe's limits [{min_pixels}, {max_pixels}]: the "
            "recipe's `min_pixels`/`max_pixels` did not reach the image processor"
        )


def check_visual_tokens(
    dataset: datasets.Dataset,
    processor: Any,
    model_config: Any,
    samples: int,
    chat_template_kwargs: dict,
    pixel_limits: tuple[int | None, int | None] = (None, None),
) -> int:
    """Render `samples` prompts (-1: all) as training does and check each against the model: the processor's
    patches fit the vision tower, the image tokens in the prompt equal the features the tower produces, the count an
    inference server would compute agrees, and the image stays inside the recipe's `pixel_limits`.

    Returns the number of prompts checked; raises `VisualTokenMismatch` naming the first row that fails.
    """
    count = len(dataset) if samples < 0 else min(samples, len(dataset))
    # Every prompt of a real GeoQA recipe (3,503, `token_check_samples: -1`) takes a while: show it.
    rows = tqdm(dataset.select(range(count)), desc="checking image tokens", disable=count < 1000)
    for row in rows:
        image = row["images"] if "images" in row else row["image"]
        rendered = processor.apply_chat_template(
            fill_image(row["prompt"], image),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            **chat_template_kwargs,
        )
        _check_row(row["id"], image, rendered, processor, model_config, pixel_limits)
    return count
