"""Model loading for every recipe: Hub ids, local folders and the embedded tiny model go through one path.

`resolve_model_path` turns a recipe's `model_name_or_path` into something `from_pretrained` can read: the embedded
default is built into the cache on first use (it is never downloaded), anything else is passed through unchanged.
From there the tiny model and `Qwen/Qwen2.5-VL-3B-Instruct` load with the same calls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from peft import LoraConfig
from transformers import AutoModelForImageTextToText, PreTrainedModel

from vision_grpo import tiny_model
from vision_grpo.processing import load_processor

logger = logging.getLogger(__name__)

# The embedded replicas, named like Hub models: the family each one replicates (vision_grpo/tiny_model.py).
EMBEDDED_FAMILIES = {
    "vision-grpo/tiny-qwen2.5-vl": "qwen2.5-vl",
    "vision-grpo/tiny-qwen3-vl": "qwen3-vl",
    "vision-grpo/tiny-qwen3.5": "qwen3.5",
}
EMBEDDED_MODELS = {
    name: functools.partial(tiny_model.build_replica, family) for name, family in EMBEDDED_FAMILIES.items()
}
TINY_MODEL = "vision-grpo/tiny-qwen2.5-vl"  # the default of the tiny recipes and the demo
# Parameter-name fragments of the vision towers of the supported families (Qwen-VL: `visual`).
VISION_MODULE_PATTERN = r".*(visual|vision_tower|vision_model).*"


def cache_dir() -> Path:
    """Where built artefacts live: `$VISION_GRPO_CACHE`, else `~/.cache/vision_grpo`. Never inside the repo's git."""
    return Path(os.environ.get("VISION_GRPO_CACHE", Path.home() / ".cache" / "vision_grpo"))


def resolve_model_path(name: str) -> str:
    """A path or Hub id that `from_pretrained` can read; builds the embedded model on first use."""
    if name in EMBEDDED_MODELS:
        target = cache_dir() / f"{name.replace('/', '--')}--{_builder_version()}"
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):  # two ranks starting together build it once
            if not (target / "config.json").exists():
                logger.info("building the embedded model %s in %s", name, target)
                _build_embedded(name, target)
        return str(target)
    path = Path(name)
    if name.startswith((".", "/", "~")) and not path.expanduser().exists():
        raise FileNotFoundError(f"model path {name} does not exist")
    if os.environ.get("HF_HUB_OFFLINE") == "1" and not path.exists():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise FileNotFoundError(
                f"model {name} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1; download it first or "
                f"use the embedded default `{TINY_MODEL}`"
            )
    return name


@functools.cache
def _builder_version() -> str:
    """A digest of the replica builder's source and the transformers version: a cached replica built by other code
    is never reused, so changing `tiny_model.py` (or upgrading transformers) rebuilds instead of loading stale files."""
    import transformers

    source = Path(tiny_model.__file__).read_bytes() + transformers.__version__.encode()
    return hashlib.sha256(source).hexdigest()[:10]


def _build_embedded(name: str, target: Path) -> None:
    """Build embedded model `name` into `target`, whichever rank of a multi-process run gets here first.

    transformers 5's `save_pretrained` writes the weights only on rank 0 of an initialised process group; built on
    another rank, the folder would hold the processor but no model. Such a rank builds in a fresh interpreter.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        code = "import sys; from vision_grpo.modeling import EMBEDDED_MODELS; EMBEDDED_MODELS[sys.argv[1]](sys.argv[2])"
        subprocess.run([sys.executable, "-c", code, name, str(target)], check=True)
    else:
        EMBEDDED_MODELS[name](target)


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
    return AutoModelForImageTextToText.from_pretrained(
        resolve_model_path(model_args.model_name_or_path),
        revision=model_args.model_revision,
        dtype=_dtype(model_args.dtype),
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=trust_remote_code,
        device_map=device_map,
    )


# Qwen's vision special tokens belong in prompts only. A completion holding one breaks the next forward pass (an image
# token without image features, a vision start without a grid), so generation must never produce them.
VISION_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def vision_special_token_ids(tokenizer: Any) -> list[int]:
    """The ids of the Qwen-VL vision tokens this tokenizer has: a model must never generate them (suppressed)."""
    vocab = tokenizer.get_vocab()
    return [vocab[token] for token in VISION_SPECIAL_TOKENS if token in vocab]


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


def get_peft_config(model_args: Any, task_args: Any) -> LoraConfig | None:
    """LoRA on every linear layer of the language model (the vision tower only if `lora_on_vision`), or None.

    `all-linear` plus an exclusion pattern works for every Qwen-VL family, whose module names differ (Qwen3.5 has
    linear-attention projections that a fixed list would miss).
    """
    if not model_args.use_peft:
        return None
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules or "all-linear",
        exclude_modules=None if task_args.lora_on_vision else VISION_MODULE_PATTERN,
        modules_to_save=model_args.lora_modules_to_save,
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
    )


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
