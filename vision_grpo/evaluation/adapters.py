"""Loading a saved LoRA adapter and proving that every one of its weights attached.

PEFT can load an adapter whose module names do not match the model (renamed modules after transformers 5 moved
Qwen-VL's language model under `model.language_model`) and then silently evaluate the base model. We compare each
tensor of the adapter file with the weight that ended up in the model and stop with the names that did not attach.
An adapter of a base with other dimensions fails inside PEFT; we turn that into the same kind of error.

Whether an adapter attaches depends on the base's module names and shapes, not its weights: the same check runs on
a model built on the meta device (`model_skeleton`), which is how the vLLM backend verifies an adapter without
holding a second copy of the base in memory beside the engine's.

An adapter that the model already holds would attach just as well and add its change twice: a merged export (its
model card records the adapter merged into it, by content) or a model folder that holds the adapter itself (which
transformers loads with the model). `check_not_in_model` refuses both before anything loads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import yaml
from huggingface_hub.repocard import metadata_load
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageTextToText, PreTrainedModel

from vision_grpo.run.locks_and_digests import content_digest

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FULL_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json")
MODEL_CARD = "README.md"
# The model card keys of an export (vision_grpo/export/model_card.py): the adapter merged into it, as given to the
# export and by content (`adapter_digest`).
MERGED_ADAPTER, MERGED_ADAPTER_WEIGHTS = "merged_adapter", "merged_adapter_weights"
SHOWN = 5  # names or error lines quoted in a message; the rest are counted


class AdapterMismatch(ValueError):
    """An adapter that does not fit the base model it is applied to."""


def _shorten(items: list[str]) -> str:
    return "; ".join(items[:SHOWN]) + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def check_adapter_dir(adapter_dir: str | Path) -> Path:
    """The folder, if it holds a PEFT adapter (a run's final folder or a `checkpoint-N`); else a clear error."""
    adapter_dir = Path(adapter_dir)
    if adapter_dir.is_file():
        raise AdapterMismatch(
            f"--adapter {adapter_dir} is a file: an adapter is the folder that holds {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS} (a run folder or its checkpoint-N); pass --adapter {adapter_dir.parent}"
        )
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


def adapter_digest(adapter_dir: str | Path) -> str:
    """The adapter by content (sha256 of its weights and config file, whatever its path): what a result's metadata
    (`adapter_weights`) and an export's model card (`merged_adapter_weights`) record, so either can be matched to it."""
    adapter_dir = Path(adapter_dir)
    return content_digest([adapter_dir / ADAPTER_WEIGHTS, adapter_dir / ADAPTER_CONFIG])


def _card_metadata(folder: Path) -> dict[str, Any]:
    """The YAML metadata of the folder's model card; empty where there is none or it does not parse (a card
    written by someone else: it records nothing of ours)."""
    if not (folder / MODEL_CARD).is_file():
        return {}
    try:
        return metadata_load(folder / MODEL_CARD) or {}
    except (yaml.YAMLError, ValueError):
        return {}


def check_not_in_model(model: str, adapter_dir: str | Path) -> None:
    """Refuse `adapter_dir` on `model` (`--model_name_or_path`) where the model's folder shows it holds that adapter
    already, by content: an export it was merged into (the card's `merged_adapter_weights`), or the adapter's own
    files (transformers loads a folder's adapter with the model). Applied again, it would add its change twice and
    the result would name an evaluation of weights nobody trained. A Hub id or an embedded model records nothing."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return
    digest = adapter_digest(adapter_dir)
    base = adapter_base_model(adapter_dir) or "the base model it was trained on"
    holds_adapter = all((folder / name).is_file() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS))
    if holds_adapter and adapter_digest(folder) == digest:
        raise AdapterMismatch(
            f"--model_name_or_path {model} holds the adapter of --adapter {adapter_dir} itself (the same "
            f"{ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}): transformers loads it with the model, so --adapter would apply "
            f"it a second time; pass its base ({base}) as --model_name_or_path"
        )
    card = _card_metadata(folder)
    if card.get(MERGED_ADAPTER_WEIGHTS) == digest:
        raise AdapterMismatch(
            f"--model_name_or_path {model} is an export with --adapter {adapter_dir} already merged into it (its "
            f"{MODEL_CARD} records {MERGED_ADAPTER} {card.get(MERGED_ADAPTER)}, the same weights by sha256): applied "
            f"again its change would count twice; evaluate {model} without --adapter, or the adapter on its base "
            f"({base})"
        )


def adapter_base_model(adapter_dir: str | Path) -> str | None:
    """The base model the adapter says it was trained on (`base_model_name_or_path`), if recorded."""
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    return config.get("base_model_name_or_path")


def model_skeleton(path: str, revision: str | None = None, trust_remote_code: bool = False) -> PreTrainedModel:
    """The model class `load_model` builds for the checkpoint at `path`, on the meta device: every module with its
    name and shape, no weights (no memory, whatever the model's size), and the generation config `from_pretrained`
    would give it (the checkpoint's `generation_config.json`, else the one derived from `config.json`)."""
    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=trust_remote_code)
    # What `from_pretrained` runs after loading the weights to read the checkpoint's generation config.
    model.adjust_generation_fn(
        generation_config=None,
        from_auto_class=True,
        from_pipeline=None,
        pretrained_model_name_or_path=path,
        cache_dir=None,
        force_download=False,
        proxies=None,
        local_files_only=False,
        token=None,
        revision=revision,
        subfolder="",
        trust_remote_code=trust_remote_code,
    )
    return model


def load_verified_adapter(model: Any, adapter_dir: str | Path, merge: bool = False) -> Any:
    """`PeftModel.from_pretrained(model, adapter_dir)`, verified weight by weight; merged if `merge`.

    On a `model_skeleton` (meta device) PEFT attaches the adapter's tensors by name, refusing other shapes, then
    moves them to the base's (meta) device: a weight attached if its name is in the model with its saved shape,
    which is what decides it on a loaded model too. Such a model cannot be merged.
    """
    adapter_dir = check_adapter_dir(adapter_dir)
    on_meta = model.device.type == "meta"
    if on_meta and merge:
        raise ValueError("an adapter cannot be merged into a model without weights (model_skeleton): load the model")
    base = adapter_base_model(adapter_dir)
    if base and base != model.name_or_path:
        # Only a warning: the same base may live under another name (Hub id here, local copy there); the weight
        # check below is what catches an adapter that does not fit.
        logger.warning("adapter %s was trained on %s; applying it to %s", adapter_dir, base, model.name_or_path)
    saved = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    try:
        # On meta, PEFT's low-memory path assigns the adapter's tensors instead of copying them into empty ones.
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), low_cpu_mem_usage=on_meta)
    except (RuntimeError, ValueError, KeyError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise AdapterMismatch(
            f"adapter {adapter_dir} (trained on {base or 'an unrecorded base'}) does not fit the base model "
            f"{model.name_or_path}: {_shorten(lines)}"
        ) from error
    loaded = get_peft_model_state_dict(peft_model)
    failed = [k for k, v in saved.items() if k not in loaded or not _attached(loaded[k], v, on_meta)]
    if failed:
        raise AdapterMismatch(
            f"{len(failed)} of {len(saved)} adapter weights of {adapter_dir} did not attach to {model.name_or_path} "
            f"(renamed modules or another base model): {_shorten(failed)}"
        )
    return peft_model.merge_and_unload() if merge else peft_model


def _attached(loaded: torch.Tensor, saved: torch.Tensor, on_meta: bool) -> bool:
    """The saved weight is the one in the model (on meta, where values are not kept: the same shape)."""
    if on_meta:
        return loaded.shape == saved.shape
    return torch.equal(loaded.to(saved.dtype).cpu(), saved)
