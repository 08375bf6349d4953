"""Loading a saved LoRA adapter and proving that every one of its weights attached.

PEFT can load an adapter whose module names do not match the model (renamed modules after transformers 5 moved
Qwen-VL's language model under `model.language_model`) and then silently evaluate the base model. We compare each
tensor of the adapter file with the weight that ended up in the model and stop with the names that did not attach.
An adapter of a base with other dimensions fails inside PEFT; we turn that into the same kind of error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FULL_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json")
SHOWN = 5  # names or error lines quoted in a message; the rest are counted


class AdapterMismatch(ValueError):
    """An adapter that does not fit the base model it is applied to."""


def _shorten(items: list[str]) -> str:
    return "; ".join(items[:SHOWN]) + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def check_adapter_dir(adapter_dir: str | Path) -> Path:
    """The folder, if it holds a PEFT adapter (a run's final folder or a `checkpoint-N`); else a clear error."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterMismatch(f"adapter folder {adapter_dir} does not exist")
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (adapter_dir / name).is_file()]
    if missing and any((adapter_dir / name).is_file() for name in FULL_MODEL_FILES):
        raise AdapterMismatch(
            f"{adapter_dir} holds full model weights, not an adapter: pass it as --model_name_or_path instead"
        )
    if missing:
        raise AdapterMismatch(f"{adapter_dir} has no {' and no '.join(missing)}: not a complete PEFT adapter folder")
    return adapter_dir


def adapter_base_model(adapter_dir: str | Path) -> str | None:
    """The base model the adapter says it was trained on (`base_model_name_or_path`), if recorded."""
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    return config.get("base_model_name_or_path")


def load_verified_adapter(model: Any, adapter_dir: str | Path, merge: bool = False) -> Any:
    """`PeftModel.from_pretrained(model, adapter_dir)`, verified weight by weight; merged if `merge`."""
    adapter_dir = check_adapter_dir(adapter_dir)
    base = adapter_base_model(adapter_dir)
    if base and base != model.name_or_path:
        # Only a warning: the same base may live under another name (Hub id here, local copy there); the weight
        # check below is what catches an adapter that does not fit.
        logger.warning("adapter %s was trained on %s; applying it to %s", adapter_dir, base, model.name_or_path)
    saved = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    except (RuntimeError, ValueError, KeyError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise AdapterMismatch(
            f"adapter {adapter_dir} (trained on {base or 'an unrecorded base'}) does not fit the base model "
            f"{model.name_or_path}: {_shorten(lines)}"
        ) from error
    loaded = get_peft_model_state_dict(peft_model)
    failed = [k for k, v in saved.items() if k not in loaded or not torch.equal(loaded[k].to(v.dtype).cpu(), v)]
    if failed:
        raise AdapterMismatch(
            f"{len(failed)} of {len(saved)} adapter weights of {adapter_dir} did not attach to {model.name_or_path} "
            f"(renamed modules or another base model): {_shorten(failed)}"
        )
    return peft_model.merge_and_unload() if merge else peft_model
