"""Loading a saved LoRA adapter and proving that every one of its weights attached.

PEFT can load an adapter whose module names do not match the model (renamed modules after transformers 5 moved
Qwen-VL's language model under `model.language_model`) and then silently evaluate the base model. We compare each
tensor of the adapter file with the weight that ended up in the model and stop with the names that did not attach.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterMismatch(ValueError):
    """An adapter that does not fit the base model it is applied to."""


def load_verified_adapter(model: Any, adapter_dir: str | Path, merge: bool = False) -> Any:
    """`PeftModel.from_pretrained(model, adapter_dir)`, verified weight by weight; merged if `merge`."""
    adapter_dir = Path(adapter_dir)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / name).is_file():
            raise AdapterMismatch(f"{adapter_dir} has no {name}: not a PEFT adapter or checkpoint folder")
    saved = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    except (RuntimeError, ValueError, KeyError) as error:
        base = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        raise AdapterMismatch(
            f"adapter {adapter_dir} (trained on {base}) does not fit this base model: {error}"
        ) from error
    loaded = get_peft_model_state_dict(peft_model)
    failed = [k for k, v in saved.items() if k not in loaded or not torch.equal(loaded[k].to(v.dtype).cpu(), v)]
    if failed:
        shown = ", ".join(failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")
        raise AdapterMismatch(f"{len(failed)} of {len(saved)} adapter weights of {adapter_dir} did not attach: {shown}")
    return peft_model.merge_and_unload() if merge else peft_model
