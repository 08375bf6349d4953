"""What sets the vision part of a Qwen-VL model apart: its parameters (the vision tower and its merger) and its
special tokens, which belong in prompts only and must never be generated.
"""

from __future__ import annotations

from typing import Any

import torch

# Parameter-name fragments of the vision towers of the supported families (Qwen-VL: `visual`).
VISION_MODULE_PATTERN = r".*(visual|vision_tower|vision_model).*"

# Qwen's vision special tokens belong in prompts only. A completion holding one breaks the next forward pass (an image
# token without image features, a vision start without a grid), so generation must never produce them.
VISION_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def vision_special_token_ids(tokenizer: Any) -> list[int]:
    """The ids of the Qwen-VL vision tokens this tokenizer has: a model must never generate them (suppressed)."""
    vocab = tokenizer.get_vocab()
    return [vocab[token] for token in VISION_SPECIAL_TOKENS if token in vocab]


def is_vision_parameter(name: str) -> bool:
    """True for parameters of the vision tower (and its merger into the language model)."""
    return any(part in name for part in ("visual", "vision_tower", "vision_model"))


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Turn off gradients of the vision tower; returns how many parameters were frozen."""
    frozen = 0
    for name, parameter in model.named_parameters():
        if is_vision_parameter(name) and parameter.requires_grad:
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen
