"""A Qwen-VL prompt as a vLLM engine takes it, for training (vision_grpo/training/vllm_generation.py) and for the
vLLM evaluation backend alike: one image placeholder per image (the engine expands it with the recipe's pixel limits),
the vision special tokens biased away, and the engine's expanded prompt checked against the trainer's, token for token.
"""

from __future__ import annotations

from typing import Any

from vision_grpo.models.vision import vision_special_token_ids

# vLLM clamps logit biases to [-100, 100]; -100 makes a token's probability ~e^-100 of what it was.
NEVER = -100.0


def collapse_image_runs(ids: list[int], image_token_id: int) -> list[int]:
    """`ids` with every run of image tokens shortened to one: the un-expanded prompt that vLLM expands itself."""
    return [token for i, token in enumerate(ids) if token != image_token_id or i == 0 or ids[i - 1] != token]


def image_runs(ids: list[int], image_token_id: int) -> list[int]:
    """The length of every run of image tokens in `ids`, in order (one run per image)."""
    runs: list[int] = []
    for i, token in enumerate(ids):
        if token == image_token_id:
            if i > 0 and ids[i - 1] == image_token_id:
                runs[-1] += 1
            else:
                runs.append(1)
    return runs


def pixel_kwargs(processor: Any) -> dict[str, Any]:
    """The processor's pixel limits as vLLM's `mm_processor_kwargs`: the engine resizes images as training does."""
    return {"size": dict(processor.image_processor.size)}


def vision_logit_bias(tokenizer: Any) -> dict[int, float]:
    """A logit bias that keeps vLLM from sampling any Qwen-VL vision special token."""
    return {token_id: NEVER for token_id in vision_special_token_ids(tokenizer)}


class PromptMismatchError(RuntimeError):
    """The engine's expanded prompt is not the trainer's: its samples would be drawn for another prompt."""


def check_engine_prompt(trainer_ids: list[int], engine_ids: list[int], image_token_id: int) -> None:
    """Refuse an engine prompt that differs from the trainer's: the samples would not belong to the trained prompt."""
    if engine_ids == trainer_ids:
        return
    raise PromptMismatchError(
        f"vLLM generated from a {len(engine_ids)}-token prompt with image-token runs "
        f"{image_runs(engine_ids, image_token_id)}; the trainer's prompt has {len(trainer_ids)} tokens with runs "
        f"{image_runs(trainer_ids, image_token_id)}. Different runs mean the engine resized the image differently "
        "(pixel limits: the recipe's min_pixels/max_pixels must reach vLLM) or expanded an expanded prompt; "
        "other differences point at the chat template."
    )
