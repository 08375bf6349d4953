"""Before training: does what the processor makes of an image fit what the model will consume?

A processor from another family, a pixel limit that did not take effect, or a chat template that renders the image
slot twice (or not at all) all train without an error message on some paths and silently misalign image features on
others. `check_visual_tokens` renders sample prompts exactly as training does and checks them against the *model's*
config, not against the processor itself, naming the first row that fails.

Checking every prompt (`samples: -1`) renders one prompt of each distinct (prompt form, image sizes) through the
processor, tens of milliseconds each, where the checking pass recorded the sizes (every prompt elsewhere): it is
done once per dataset, processor and model, and remembered under the `datasets` cache (beside the checked rows, see
data/prepared.py); a later start with the same ones checks a sample.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
from datasets.fingerprint import Hasher
from tqdm.auto import tqdm

from vision_grpo.data import prepared, prompts_and_images
from vision_grpo.data.prompts_and_images import fill_image
from vision_grpo.storage.writes import write_text_atomic

logger = logging.getLogger(__name__)

RECHECK_SAMPLES = 32  # prompts a later start checks once every prompt was checked with the same key


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
    """Render `samples` prompts as training does and check each against the model: the processor's patches fit the
    vision tower, the image tokens in the prompt equal the features the tower produces, the count an inference
    server would compute agrees, and the image stays inside the recipe's `pixel_limits`.

    `samples: -1` checks every prompt once per rows, processor, model, template arguments and limits; a later start
    with all of them the same checks the first `RECHECK_SAMPLES`. Returns the number of prompts checked now; raises
    `VisualTokenMismatch` naming the first row that fails.
    """
    if samples >= 0:
        return _check_rows(
            dataset, range(min(samples, len(dataset))), processor, model_config, chat_template_kwargs, pixel_limits
        )
    record = _record_path(dataset, processor, model_config, chat_template_kwargs, pixel_limits)
    if record.is_file():
        count = min(RECHECK_SAMPLES, len(dataset))
        logger.info(
            "image tokens of all %d prompts were checked at an earlier start with this processor and model (%s); "
            "checking %d now",
            len(dataset),
            record,
            count,
        )
        return _check_rows(dataset, range(count), processor, model_config, chat_template_kwargs, pixel_limits)
    checked = _check_every_prompt(dataset, processor, model_config, chat_template_kwargs, pixel_limits)
    record.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(record, json.dumps({"prompts_checked": checked}))  # only once every prompt passed
    return checked


def _record_path(
    dataset: datasets.Dataset, processor: Any, model_config: Any, chat_template_kwargs: dict, pixel_limits: tuple
) -> Path:
    """Where a complete check is remembered, keyed by everything that decides its outcome: the rows (their `datasets`
    fingerprint: source, recipe keys and the code that built them), the processor's image settings, chat template and
    tokenizer, the model's config, the template arguments, the limits and this check's code."""
    tokenizer = processor.tokenizer
    image_token = getattr(processor, "image_token", None)
    key = Hasher.hash(
        [
            dataset._fingerprint,
            processor.image_processor.to_dict(),
            getattr(processor, "chat_template", None),
            [tokenizer.name_or_path, len(tokenizer), image_token, tokenizer.convert_tokens_to_ids(image_token)],
            model_config.to_dict(),
            chat_template_kwargs,
            list(pixel_limits),
            prepared.code_digest(sys.modules[__name__], prompts_and_images),
        ]
    )
    return Path(datasets.config.HF_DATASETS_CACHE) / prepared.ROWS_CACHE / "token_checks" / f"{key}.json"


def _check_every_prompt(
    dataset: datasets.Dataset, processor: Any, model_config: Any, chat_template_kwargs: dict, pixel_limits: tuple
) -> int:
    """Every prompt checked; returns how many. What the check finds depends on the chat template (and its
    arguments), the prompt's form (its messages and where their image slots are) and the sizes of its images, not
    on its text: the checking pass refuses text holding a special token, so text never adds an image token. Where
    the pass recorded the sizes (`prepared.image_sizes`), one prompt of each distinct (form, sizes) is rendered and
    stands for the others: the cost grows with the distinct sizes, not the rows. Elsewhere every prompt is
    rendered."""
    sizes = prepared.image_sizes(dataset)
    if sizes is None:
        return _check_rows(dataset, range(len(dataset)), processor, model_config, chat_template_kwargs, pixel_limits)
    forms = dataset.with_format("arrow")[:]["prompt"].to_pylist()  # one column read whole, no image decoded
    first: dict[Any, int] = {}
    for index, (prompt, row_sizes) in enumerate(zip(forms, sizes, strict=True)):
        form = tuple((message["role"], tuple(part["type"] for part in message["content"])) for message in prompt)
        first.setdefault((form, tuple(row_sizes)), index)
    _check_rows(dataset, sorted(first.values()), processor, model_config, chat_template_kwargs, pixel_limits)
    logger.info(
        "image tokens: %d distinct (prompt form, image sizes) rendered for all %d prompts", len(first), len(dataset)
    )
    return len(dataset)


def _check_rows(
    dataset: datasets.Dataset,
    indices: Sequence[int],
    processor: Any,
    model_config: Any,
    chat_template_kwargs: dict,
    pixel_limits: tuple,
) -> int:
    """The rows at `indices` checked; returns how many."""
    # Every prompt of a real GeoQA recipe (3,503) takes a while: show it.
    rows = tqdm(dataset.select(indices), desc="checking image tokens", disable=len(indices) < 1000)
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
    return len(indices)
