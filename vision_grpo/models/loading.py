"""Model and processor loading for every recipe: Hub ids, local folders and the embedded tiny models go through one
path (`resolve_model_path`), then through the same `from_pretrained` calls.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, PreTrainedModel

from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.models.gated_deltanet import (
    describe_gated_deltanet_path,
    gated_deltanet_path,
    has_linear_attention,
    old_fla_message,
)
from vision_grpo.models.processing import load_processor

logger = logging.getLogger(__name__)


def _dtype(name: str | None) -> Any:
    if name in (None, "auto"):
        return "auto"
    return getattr(torch, name)


def load_model(model_args: Any, trust_remote_code: bool = False, device_map: Any = None) -> PreTrainedModel:
    """The vision-language model of a recipe's `ModelConfig` (`trust_remote_code` off unless the recipe sets it).

    `device_map`: None (training: the trainer places the model), a device, or `"auto"` (spread over the GPUs).
    """
    if trust_remote_code:
        logger.warning("trust_remote_code is on: code from %s will run", model_args.model_name_or_path)
    path = resolve_model_path(model_args.model_name_or_path)
    refused = old_fla_message()  # None unless an old flash-linear-attention is installed: no config read then
    if refused and has_linear_attention(
        AutoConfig.from_pretrained(path, revision=model_args.model_revision, trust_remote_code=trust_remote_code)
    ):
        raise RuntimeError(f"{model_args.model_name_or_path}: {refused}")
    model = AutoModelForImageTextToText.from_pretrained(
        path,
        revision=model_args.model_revision,
        dtype=_dtype(model_args.dtype),
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=trust_remote_code,
        device_map=device_map,
    )
    if has_linear_attention(model.config):
        logger.info(describe_gated_deltanet_path(gated_deltanet_path()))
    return model


def get_processor(model_args: Any, task_args: Any, trust_remote_code: bool = False):
    """The model's processor with the recipe's pixel limits (image-only where torchvision is missing)."""
    return load_processor(
        resolve_model_path(model_args.model_name_or_path),
        min_pixels=task_args.min_pixels,
        max_pixels=task_args.max_pixels,
        trust_remote_code=trust_remote_code,
    )


def max_pixels_of(processor: Any) -> int:
    """The processor's upper pixel limit, which image normalisation shrinks to."""
    size = processor.image_processor.size
    return int(size["longest_edge"] if "longest_edge" in size else size["max_pixels"])
