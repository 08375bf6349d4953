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
import subprocess
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import yaml

from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.plugins.rewards import reward_sources
from vision_grpo.plugins.tasks import task_of
from vision_grpo.run.locks_and_digests import content_digest
from vision_grpo.storage.writes import write_text_atomic

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
    root = Path(__file__).resolve().parents[2]
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


def explicit_settings(recipe_path: str | None, argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Keys the recipe file or the command line set explicitly, in that order, and the recipe's `env:` block (TRL's
    environment variables, set while the recipe is parsed; empty without one)."""
    recipe = (yaml.safe_load(Path(recipe_path).read_text(encoding="utf-8")) or {}) if recipe_path else {}
    keys = list(recipe)
    for token in argv:
        if token.startswith("--") and token != "--config":
            key = token[2:].split("=", 1)[0]
            if key not in keys:
                keys.append(key)
    return keys, recipe.get("env") or {}


def resolved_recipe(keys: list[str], configs: tuple[Any, ...], env: dict[str, Any]) -> dict[str, Any]:
    """The final value of each explicitly set key (after CLI overrides and the run folder's output_dir), and the
    recipe's `env` block as written, so that the folder's recipe.yaml reproduces the run's environment too."""
    values: dict[str, Any] = {"env": env} if env else {}
    for config in configs:
        for f in dataclasses.fields(config):
            if f.name in keys and f.name not in values:
                value = getattr(config, f.name)
                values[f.name] = value.value if hasattr(value, "value") else value
    return {key: values[key] for key in keys if key in values}


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


def code_identity(task_args: Any) -> dict[str, str]:
    """The code that decides what a run computes beyond its keys: the task's file and each reward's plugin file, by
    content (`task shapes: <path> sha256:<first 16>`). A resume compares it (vision_grpo/run/resume.py)."""
    task = task_of(task_args)
    files = {f"task {task.name}": task.source}
    names = task_args.reward_funcs or task.default_rewards
    files |= {f"reward {name}": source for name, source in reward_sources(names, task_args.reward_dirs).items()}
    return {
        what: f"{source} sha256:{hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16]}"
        for what, source in files.items()
        if Path(source).is_file()
    }


def _hardware() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        # The vector kernels torch picked for this CPU: runs on CPUs with other ones sum in another order, and their
        # numbers drift apart over hundreds of steps (benchmarks/determinism.py).
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def write_run_start(run_dir: Path, recipe_path: str | None, argv: list[str], configs: tuple[Any, ...], **extra) -> None:
    """Write `manifest.json` and then `recipe.yaml` into the run folder (`START_FILES`).

    The manifest first: a start killed between the two leaves a folder that is provably a run of ours and holds no
    checkpoint, so the same command takes it over (a `recipe.yaml` without its manifest is not provably ours, and would
    block the folder).
    A resumed run (`resumed_from` set) keeps the manifest's first start and adds this start to `resumes`.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    keys, env = explicit_settings(recipe_path, argv)
    recipe = resolved_recipe(keys, configs, env)
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
        # Every checkpoint of this run gets a checksums.json (CheckpointChecksums), so one without it is not resumed
        # unverified; a run started before checksums were recorded keeps its own answer.
        "checkpoint_checksums": True if earlier is None else earlier.get("checkpoint_checksums", False),
        **extra,
    }
    _write_json(run_dir / "manifest.json", manifest)
    write_text_atomic(run_dir / "recipe.yaml", yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True))


# What `write_run_start` writes, in this order.
START_FILES = ("manifest.json", "recipe.yaml")


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    """The run folder's `manifest.json`, or None when it has none."""
    path = run_dir / "manifest.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def write_run_end(run_dir: Path, **extra: Any) -> None:
    """Add the end time (and anything else known only at the end) to `manifest.json`."""
    path = run_dir / "manifest.json"
    manifest = json.loads(path.read_text(encoding="utf-8"))
    manifest.update(ended=datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra)
    _write_json(path, manifest)


# What `write_run_start` puts into every manifest: a folder whose manifest.json lacks one is not a run of ours.
MANIFEST_KEYS = ("argv", "started", "packages", "git", "hardware")


def run_folder_fault(run_dir: Path, output_dir: Path) -> str | None:
    """Why `run_dir` is not provably one of our run folders inside `output_dir` (so must never be deleted), or None.

    Ours: a real folder (not a symbolic link, and reached through none below `output_dir`) strictly inside
    `output_dir`, holding a `manifest.json` as `write_run_start` writes it.
    """
    if run_dir.is_symlink():
        return f"{run_dir} is a symbolic link (to {os.readlink(run_dir)})"
    inside, resolved = output_dir.resolve(), run_dir.resolve()
    if resolved == inside or inside not in resolved.parents:
        return f"{run_dir} is not inside output_dir {output_dir}"
    if resolved.relative_to(inside) != run_dir.absolute().relative_to(output_dir.absolute()):
        return f"{run_dir} is reached through a symbolic link"
    try:
        manifest = read_manifest(run_dir)
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or any(key not in manifest for key in MANIFEST_KEYS):
        return f"{run_dir} holds no manifest.json of a run"
    return None


def _write_json(path: Path, content: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(content, indent=2, ensure_ascii=False, default=str))
