"""What a run folder records besides TRL's events and checkpoints: the resolved recipe and a manifest.

`recipe.yaml` holds every key the recipe file or the command line set, with the value the run actually used, so
two runs can be compared key by key. `manifest.json` holds what the recipe cannot: package versions, git commit
and whether the tree was dirty, hardware, start and end time; the entry point adds the dataset and the seed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import re
import secrets
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

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
        # Every checkpoint of this run gets a checksums.json (CheckpointChecksums), so one without it is not resumed
        # unverified; a run started before checksums were recorded keeps its own answer.
        "checkpoint_checksums": True if earlier is None else earlier.get("checkpoint_checksums", False),
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
    """sha256 over the names and bytes of `files`: what identifies weights by content, whatever their path.

    Remembered by each file's path, size, modification time and inode (`digest_cache_path`): a multi-GB model is
    read once, not at every start while the other ranks wait for the main process.
    """
    key = json.dumps([[str(p.resolve()), *_file_stamp(p)] for p in sorted(files, key=lambda p: p.name)])
    cache = _read_digest_cache()
    if key in cache:
        return cache[key]
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as source:
            while chunk := source.read(1 << 24):
                digest.update(chunk)
    if key == json.dumps([[str(p.resolve()), *_file_stamp(p)] for p in sorted(files, key=lambda p: p.name)]):
        _remember_digest(key, digest.hexdigest())  # only if no file changed while it was read
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of one file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _file_stamp(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


def digest_cache_path() -> Path:
    """Where content digests are remembered: `$VISION_GRPO_CACHE` or `~/.cache/vision_grpo`, file `digests.json`."""
    root = os.environ.get("VISION_GRPO_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(root) / "vision_grpo" / "digests.json"


def _read_digest_cache() -> dict[str, str]:
    try:
        cache = json.loads(digest_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: digests are then computed, never guessed
        return {}
    return cache if isinstance(cache, dict) else {}


def _remember_digest(key: str, digest: str) -> None:
    path = digest_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache = _read_digest_cache()
        cache[key] = digest
        write_text_atomic(path, json.dumps(dict(list(cache.items())[-256:])))
    except OSError:  # a read-only home: the digest is still right, only not remembered
        pass


# ---------------------------------------------------------------------------------------------------------------------
# Locks and what is provably a run folder of ours.


@contextmanager
def hold_lock(lock: Path, busy: Callable[[str], Exception]) -> Iterator[None]:
    """Hold the lock file `lock` while the block runs; raise `busy(holder's pid)` at once if another process holds it.

    An OS lock (`flock`): it ends with its process, however that process ends, so a lock left by a killed run is
    recognised as stale and taken over. The holder's pid is written into the file for the message. The file is
    removed on leaving.
    """
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 20).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise busy(holder) from None
        if lock.exists() and os.stat(lock).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)  # locked a file its last holder removed on leaving: lock the one at the path now
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


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


# ---------------------------------------------------------------------------------------------------------------------
# Checksums of what a checkpoint holds.

CHECKSUMS = "checksums.json"
# Written by the other ranks while the main process may already be hashing: theirs to check, not ours.
OTHER_RANKS_FILES = re.compile(r"rng_state_[1-9][0-9]*\.pth")


def write_checksums(checkpoint: Path) -> None:
    """Record the size and sha256 of every file the main process wrote into `checkpoint` (`checksums.json`)."""
    files = sorted(
        p
        for p in checkpoint.iterdir()
        if p.is_file() and p.name != CHECKSUMS and not OTHER_RANKS_FILES.fullmatch(p.name)
    )
    sums = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files}
    write_text_atomic(checkpoint / CHECKSUMS, json.dumps(sums, indent=1))


def checksum_fault(checkpoint: Path) -> str | None:
    """The first file of `checkpoint` that is missing, cut short or changed since it was saved, or None (also for a
    checkpoint of a run started before checksums were recorded: nothing to compare). In a run folder whose manifest
    says its checkpoints carry checksums, a checkpoint without them is a fault: its files cannot be verified (the
    save was cut before they were written, or they were deleted)."""
    path = checkpoint / CHECKSUMS
    if not path.is_file():
        manifest = read_manifest(checkpoint.parent) or {}
        return f"no {CHECKSUMS}, so its files cannot be verified" if manifest.get("checkpoint_checksums") else None
    try:
        sums = json.loads(path.read_bytes())
    except ValueError:
        return f"a {CHECKSUMS} that is not valid JSON"
    for name, expected in sums.items():
        file = checkpoint / name
        if not file.is_file():
            return f"no {name} (listed in {CHECKSUMS})"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{name} of {size} bytes, saved with {expected['bytes']} (cut short or replaced)"
        if file_sha256(file) != expected["sha256"]:
            return f"{name} corrupted: its bytes changed since it was saved (sha256 differs from {CHECKSUMS})"
    return None


class CheckpointChecksums(TrainerCallback):
    """After each checkpoint save, record the checksums of its files, so a resume notices a corrupted one."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if folder.is_dir():
                write_checksums(folder)
        return control
