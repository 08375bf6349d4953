"""Resuming a run: the checkpoint to continue (`resume_from_checkpoint` as a path, or `last`), skipped when it was
cut off while saving or changed since, and the refusal of a resume that would compute differently from the run it
continues (its folder's `recipe.yaml` and manifest against the settings now).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import yaml
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from vision_grpo.run.checksums import checksum_fault
from vision_grpo.run.manifest import code_identity, dataset_identity, explicit_settings, read_manifest, resolved_recipe

logger = logging.getLogger(__name__)


class RunConflict(ValueError):
    """A run folder that holds another run, or a resume that would continue a run with other settings."""


class NothingLeftToTrain(Exception):
    """Raised by `EndAtMaxSteps` once the checkpoint is loaded: the run is at its last step."""


class EndAtMaxSteps(TrainerCallback):
    """A resume from a checkpoint already at `max_steps` (a run killed after its last checkpoint, before its end
    record) must train nothing. transformers' loop checks `max_steps` only after a step, so when the last epoch is
    partial (3 steps of 2 per epoch) it runs one step more (measured: a fourth reward call, `checkpoint-4`, a
    manifest at step 4). At `on_train_begin` the checkpoint's weights, optimizer and state are loaded, whatever the
    backend (DeepSpeed's engine loads its own): stopping there leaves the model as the checkpoint has it."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            raise NothingLeftToTrain(state.global_step)


def check_resume(
    resume_from: str, recipe_path: str | None, argv: list[str], configs: tuple[Any, ...], model_weights: dict[str, Any]
) -> None:
    """Refuse to continue a checkpoint with settings that compute differently from its run's (its folder's
    `recipe.yaml` and manifest), unless the recipe's `resume_allow_changes` names the keys."""
    allowed = configs[0].resume_allow_changes
    never = sorted(NEVER_ON_RESUME & set(allowed))
    if never:
        raise RunConflict(
            f"cannot resume {resume_from}: resume_allow_changes lists {never}, which a resume can never change (the "
            "checkpoint's adapter and optimizer state have the shapes those keys gave them); remove them from "
            "resume_allow_changes, or start a new run under another --run_name"
        )
    changes = resume_changes(Path(resume_from).parent, recipe_path, argv, configs, model_weights, allowed)
    if changes:
        raise RunConflict(
            f"cannot resume {resume_from}: this run would compute differently from the run it continues "
            f"({'; '.join(changes)}); restore those values, list the keys in resume_allow_changes to accept them, "
            "or start a new run under another --run_name"
        )


RESUME_LAST = ("true", "last")


# Written last by the Trainer's checkpoint save: a checkpoint folder without it was cut off while saving.
TRAINER_STATE = "trainer_state.json"


def resume_checkpoint(value: str | bool | None, run_dir: Path) -> str | None:
    """The checkpoint a run resumes from: `resume_from_checkpoint` as a path, or `true`/`last` for the run folder's
    last complete checkpoint (rerun with the same `output_dir` and `run_name`). None: start from scratch.

    A checkpoint cut off by a kill while saving (see `checkpoint_fault`) is skipped, naming why, not loaded half-way.
    """
    if value is None or value is False or str(value).lower() in ("", "false", "none"):
        return None
    if value is True or str(value).lower() in RESUME_LAST:
        complete = sorted(
            (p for p in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.name.split("-")[-1].isdigit()),
            key=lambda p: int(p.name.split("-")[-1]),
        )
        while complete and (fault := checkpoint_fault(complete[-1])):  # newest first: older ones are not read
            logger.warning("skipping %s: it has %s; trying the checkpoint before it", complete[-1], fault)
            complete.pop()
        if not complete:
            raise FileNotFoundError(
                f"resume_from_checkpoint={value}: no complete checkpoint in {run_dir}; rerun with the interrupted "
                "run's `output_dir` and `run_name`, or pass a checkpoint folder"
            )
        return str(complete[-1])
    path = Path(str(value)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"resume_from_checkpoint: {path} does not exist")
    if fault := checkpoint_fault(path):
        raise FileNotFoundError(f"resume_from_checkpoint: {path} has {fault} (not a complete checkpoint)")
    return str(path)


def checkpoint_fault(folder: Path) -> str | None:
    """Why `folder` is not a complete, intact checkpoint, or None. The Trainer writes `trainer_state.json` last, and
    not atomically: a save cut off by a kill or a full disk has none, or one cut short at any byte (cut off while
    saving). A file that differs from the checksums recorded after the save (`checksums.json`) was cut short or
    corrupted later; it is named here, before torch or safetensors read it."""
    state = folder / TRAINER_STATE
    if not state.is_file():
        return f"no {TRAINER_STATE}"
    try:
        json.loads(state.read_bytes())
    except ValueError:  # invalid JSON, or UTF-8 cut inside a character
        return f"a {TRAINER_STATE} cut short"
    return checksum_fault(folder)


# Keys a resumed run may change without being told: where and how often it records and saves, what it checks
# before starting, and the run's length (a finished run continues when `max_steps` grows).
RESUME_FREE_KEYS = frozenset(
    {
        "output_dir",
        "run_name",
        "resume_from_checkpoint",
        "resume_allow_changes",
        "overwrite_run",
        "max_steps",
        "num_train_epochs",
        "report_to",
        "logging_steps",
        "logging_first_step",
        "save_steps",
        "save_strategy",
        "save_total_limit",
        "token_check_samples",
        "log_completions",
        "num_completions_to_print",
        "dataloader_num_workers",
        "rank_stall_timeout",
        "env",  # environment variables: the machine's settings (offline, allocator), like the keys above
    }
)


# Keys that give the checkpoint's tensors their shapes (LoRA's layers and rank, which parameters train and so what
# the optimizer state holds): a resume that changes them cannot load the checkpoint, so no key accepts the change.
NEVER_ON_RESUME = frozenset(
    {"use_peft", "lora_r", "lora_target_modules", "lora_modules_to_save", "use_dora", "vision_tower"}
)


def _default(configs: tuple[Any, ...], key: str) -> Any:
    """The value a run got for `key` when neither its recipe nor its command line set it: the field's default."""
    for config in configs:
        for f in dataclasses.fields(config):
            if f.name == key:
                value = f.default_factory() if f.default is dataclasses.MISSING else f.default
                return value.value if hasattr(value, "value") else value
    return None


def resume_changes(
    earlier_run: Path,
    recipe_path: str | None,
    argv: list[str],
    configs: tuple[Any, ...],
    model_weights: dict[str, Any],
    allowed: list[str],
) -> list[str]:
    """What a resumed run would compute differently from the run it continues, one `key: then, now` line each;
    `configs` as parsed (the task arguments first), `model_weights` the model's `model_identity` now.

    Compared: every key either run set (a key one run left unset had its default), except `RESUME_FREE_KEYS` and
    `allowed`, and the dataset's identity and the model's weights (`model_weights`) in the manifest; where those
    weights are recorded, the model is compared by them, not by its path. An earlier run with no `recipe.yaml`
    cannot be compared.
    """
    recorded = earlier_run / "recipe.yaml"
    if not recorded.is_file():
        return []
    then = yaml.safe_load(recorded.read_text(encoding="utf-8")) or {}
    keys_now, env = explicit_settings(recipe_path, argv)
    keys = list(dict.fromkeys([*then, *keys_now]))
    now = yaml.safe_load(yaml.safe_dump(resolved_recipe(keys, configs, env), allow_unicode=True))
    manifest = read_manifest(earlier_run) or {}
    by_content = {"model_name_or_path", "model_revision"} if "model_weights" in manifest else set()
    changes = []
    for key in keys:
        if key in RESUME_FREE_KEYS or key in allowed or key in by_content:
            continue
        before, after = then.get(key, _default(configs, key)), now.get(key, _default(configs, key))
        if before != after:
            changes.append(f"{key}: {before!r} then, {after!r} now")
    identities = {
        "dataset": json.loads(json.dumps(dataset_identity(configs[0]), default=str)),
        "model_weights": model_weights,
    }
    for key, now_value in identities.items():
        if key in manifest and key not in allowed and manifest[key] != now_value:
            changes.append(f"{key}: {manifest[key]!r} then, {now_value!r} now")
    if "code" in manifest and "code" not in allowed:  # the task's and rewards' files, named one by one
        code = code_identity(configs[0])
        changes += [
            f"code of {what}: {manifest['code'].get(what)} then, {code.get(what)} now"
            for what in dict.fromkeys([*manifest["code"], *code])
            if manifest["code"].get(what) != code.get(what)
        ]
    return changes


def finished_step(run_dir: Path, max_steps: int, num_train_epochs: float) -> int | None:
    """The step a run ended at, if it completed what is asked now; None if there is more to do.

    Finished: the manifest records an end at the step the run planned (not a stop on a signal), and the request is
    not for more (`max_steps` not larger; with `max_steps` unset, the same number of epochs).
    """
    manifest = read_manifest(run_dir)
    if manifest is None or manifest.get("ended") is None or manifest.get("max_steps") is None:
        return None
    step = manifest["global_step"]
    if step < manifest["max_steps"]:
        return None
    if max_steps > 0:
        return step if step >= max_steps else None
    return step if num_train_epochs == manifest.get("num_train_epochs") else None
