"""What an export checks before it writes a model that must answer as the trained policy did: the run's base weights
by content, the output free (and held by a lock), the shard size, an evaluation of these very weights for the card,
no PEFT names left in the merged folder, and a push refused before any work where the Hub is unreachable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from huggingface_hub.serialization._base import parse_size_to_int  # what save_pretrained parses with
from safetensors import safe_open
from transformers.utils import cached_file
from trl import ModelConfig

from vision_grpo.evaluation.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, FULL_MODEL_FILES, adapter_digest
from vision_grpo.evaluation.results import not_a_result
from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.models.vision import is_vision_parameter
from vision_grpo.run.locks_and_digests import hold_lock
from vision_grpo.run.manifest import model_identity

logger = logging.getLogger("vision_grpo.export")


# Fragments of parameter names that only a PEFT-wrapped model has: a merged folder holding one would load with
# those weights missing or unused (transformers warns, vLLM refuses or ignores them).
PEFT_NAME_PARTS = ("lora_", "base_layer", "base_model.model", "modules_to_save", "original_module")


class ExportError(ValueError):
    """An export that would not give a model that answers as the trained policy did."""


def run_folder_of(adapter: Path) -> Path:
    """The run folder of a run's final folder or of one of its `checkpoint-N` folders (where recipe.yaml is)."""
    if (adapter / "recipe.yaml").is_file() or not adapter.name.startswith("checkpoint-"):
        return adapter
    return adapter.parent


def is_full_model(folder: Path) -> bool:
    """A folder of full model weights (full fine-tuning), not a PEFT adapter."""
    return not (folder / ADAPTER_CONFIG).is_file() and any((folder / name).is_file() for name in FULL_MODEL_FILES)


def shard_size(value: str) -> str:
    """`--max_shard_size` as `save_pretrained` will read it (huggingface_hub's parser: a number and TB, GB, MB or KB),
    checked while the arguments are parsed, not after the merge."""
    try:
        size = parse_size_to_int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a size: give a number and a unit, e.g. 5GB or 500MB"
        ) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive size: give e.g. 5GB or 500MB")
    return value


def read_eval_result(path: Path) -> dict[str, Any]:
    """The `--eval` result file, read before any model loads: a missing file or one that is not a result is named."""
    if not path.is_file():
        raise ExportError(
            f"--eval {path} does not exist: pass the result file eval/evaluate.py wrote for these weights"
        )
    if why := not_a_result(path):
        raise ExportError(f"--eval {path} is not a result file of eval/evaluate.py ({why})")
    return json.loads(path.read_text(encoding="utf-8"))


def hold_output(output: Path) -> AbstractContextManager[None]:
    """Hold `<output>.lock` for the whole export: a second export to the same folder fails at once, naming the
    first, instead of failing at its end on the folder the first one renamed into place."""
    return hold_lock(
        output.with_name(output.name + ".lock"),
        lambda holder: ExportError(
            f"another export (pid {holder}) is writing {output}: wait for it to end or choose another --output"
        ),
    )


def check_output_free(output: Path) -> None:
    if output.is_symlink():
        raise ExportError(
            f"--output {output} is a symbolic link (to {os.readlink(output)}): the export is renamed into place, "
            "which replaces a link, not its target; pass the target folder itself as --output"
        )
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ExportError(f"output {output} already holds something: choose another --output or empty it first")
    nearest = next(folder for folder in output.parents if folder.exists())  # missing ones are made for the export
    if not nearest.is_dir():
        raise ExportError(f"--output {output} is inside {nearest}, which is a file: choose another --output")


def check_base(adapter: Path, manifest: dict[str, Any] | None, model_args: ModelConfig) -> dict[str, Any]:
    """The base the recipe names, present and, where the run's manifest records the weights it trained on, the same
    weights by content; returns its `model_identity`."""
    name = model_args.model_name_or_path
    try:
        resolve_model_path(name)
        cached_file(resolve_model_path(name), "config.json", revision=model_args.model_revision)
    except (OSError, FileNotFoundError) as error:
        raise ExportError(
            f"the base model of {adapter}, {name}, is not available here ({error}): download it, or pass "
            "--model_name_or_path with a local copy of the same weights"
        ) from None
    identity = model_identity(name, model_args.model_revision)
    recorded = (manifest or {}).get("model_weights")
    if recorded is None:
        logger.warning("%s records no model_weights: the base %s is checked only weight by weight", adapter, name)
    elif recorded != identity:
        raise ExportError(
            f"adapter {adapter} was trained on other weights than {name} holds (the run's manifest records "
            f"{recorded}, {name} is {identity}): pass --model_name_or_path with the run's base model"
        )
    return identity


def vision_lora_modules(adapter: Path) -> list[str]:
    """The adapter's weights on the vision tower. vLLM serves such LoRA only behind an experimental switch
    (`enable_tower_connector_lora`), so merging is the way to serve them: export merges them with the rest."""
    with safe_open(str(adapter / ADAPTER_WEIGHTS), "pt") as weights:
        names = weights.keys()  # a safetensors handle, not a dict
    return [key for key in names if is_vision_parameter(key)]


def peft_names(folder: Path) -> list[str]:
    """Weight names in the folder's safetensors files that only a PEFT model has."""
    names = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            keys = weights.keys()  # a safetensors handle, not a dict
        names += [key for key in keys if any(part in key for part in PEFT_NAME_PARTS)]
    return names


def check_push_possible(repo: str | None) -> None:
    from huggingface_hub import constants

    if repo and constants.HF_HUB_OFFLINE:
        raise ExportError(
            f"--push_to_hub {repo} needs the Hub, and HF_HUB_OFFLINE=1 here: export without it, then push the folder "
            "from a machine with network access (`hf upload <repo> <folder>`)"
        )


def adapter_weights(adapter: Path, full: bool) -> dict[str, Any]:
    """The exported weights' origin by content, as eval/evaluate.py records it in a result's metadata."""
    if full:
        return {"model_weights": model_identity(str(adapter), None)}
    return {"adapter_weights": adapter_digest(adapter)}


def check_eval_matches(path: Path, result: dict[str, Any], weights: dict[str, Any]) -> None:
    """A card's evaluation must be of these weights: the result's recorded adapter (or model) digest must match."""
    metadata = result.get("metadata", {})
    if "summary" not in result or "records" not in result:
        raise ExportError(f"--eval {path} is not a result file of eval/evaluate.py (no summary or records)")
    for key, value in weights.items():
        if metadata.get(key) != value:
            raise ExportError(
                f"--eval {path} evaluated other weights ({key}: {metadata.get(key)!r} there, {value!r} here): "
                "evaluate this adapter (eval/evaluate.py --adapter ...) and pass that result"
            )
