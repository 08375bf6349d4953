"""What a run folder records besides TRL's events and checkpoints: the resolved recipe and a manifest.

`recipe.yaml` holds every key the recipe file or the command line set, with the value the run actually used, so
two runs can be compared key by key. `manifest.json` holds what the recipe cannot: package versions, git commit
and whether the tree was dirty, hardware, start and end time; the entry point adds the dataset and the seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import secrets
import subprocess
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import yaml

from vision_grpo.modeling import resolve_model_path
from vision_grpo.tasks import task_of

PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "deepspeed", "vision-grpo-recipes")


def package_versions() -> dict[str, str | None]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def git_state() -> dict[str, Any]:
    """The commit of the code that ran and whether it had uncommitted changes (None outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def set_keys(recipe_path: str | None, argv: list[str]) -> list[str]:
    """Keys the recipe file or the command line set explicitly, in that order."""
    keys: list[str] = []
    if recipe_path:
        keys += list(yaml.safe_load(Path(recipe_path).read_text(encoding="utf-8")) or {})
    for token in argv:
        if token.startswith("--") and token != "--config":
            key = token[2:].split("=", 1)[0]
            if key not in keys:
                keys.append(key)
    return keys


def resolved_recipe(keys: list[str], configs: tuple[Any, ...]) -> dict[str, Any]:
    """The final value of each explicitly set key (after CLI overrides and the run folder's output_dir)."""
    values: dict[str, Any] = {}
    for config in configs:
        for f in dataclasses.fields(config):
            if f.name in keys and f.name not in values:
                value = getattr(config, f.name)
                values[f.name] = value.value if hasattr(value, "value") else value
    return {key: values[key] for key in keys if key in values}


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
    }
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
    keys = list(dict.fromkeys([*then, *set_keys(recipe_path, argv)]))
    now = yaml.safe_load(yaml.safe_dump(resolved_recipe(keys, configs), allow_unicode=True)) or {}
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
    return changes


def model_identity(name: str, revision: str | None) -> dict[str, Any]:
    """A model by content, not path: sha256 of a local (or embedded) model's weights and config; a Hub model not on
    disk by its id and revision."""
    folder = Path(resolve_model_path(name))
    files = [*sorted(folder.glob("*.safetensors")), folder / "config.json"] if folder.is_dir() else []
    return {"sha256": content_digest(files)} if files else {"id": name, "revision": revision}


def dataset_identity(task_args: Any) -> dict[str, Any]:
    """Which data a run or an evaluation saw, as the recipe's task declares it (source and pinned revision, or a
    generator's settings); manifests and result files record the same."""
    return task_of(task_args).identity(task_args)


def _hardware() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def write_run_start(run_dir: Path, recipe_path: str | None, argv: list[str], configs: tuple[Any, ...], **extra) -> None:
    """Write `recipe.yaml` and `manifest.json` into the run folder.

    A resumed run (`resumed_from` set) keeps the manifest's first start and adds this start to `resumes`.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe = resolved_recipe(set_keys(recipe_path, argv), configs)
    write_text_atomic(run_dir / "recipe.yaml", yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True))
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    earlier = read_manifest(run_dir) if extra.get("resumed_from") else None
    resumes = [] if earlier is None else [*earlier.get("resumes", []), {"at": now, "from": extra["resumed_from"]}]
    manifest = {
        "recipe": recipe_path,
        "argv": argv,
        "started": now if earlier is None else earlier["started"],
        "resumes": resumes,
        "ended": None,
        "packages": package_versions(),
        "git": git_state(),
        "hardware": _hardware(),
        **extra,
    }
    _write_json(run_dir / "manifest.json", manifest)


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    """The run folder's `manifest.json`, or None when it has none."""
    path = run_dir / "manifest.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


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


def write_run_end(run_dir: Path, **extra: Any) -> None:
    """Add the end time (and anything else known only at the end) to `manifest.json`."""
    path = run_dir / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    manifest.update(ended=datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra)
    _write_json(path, manifest)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` through a temporary file and rename: the final name never holds a partial file.

    The temporary name is unique, so two writers of one file never write into, or rename, each other's half-file.
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("x", encoding="utf-8") as sink:  # the process's umask applies, as for any file it writes
            sink.write(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def content_digest(files: list[Path]) -> str:
    """sha256 over the names and bytes of `files`: what identifies weights by content, whatever their path."""
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as source:
            while chunk := source.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, content: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(content, indent=2, ensure_ascii=False, default=str))
