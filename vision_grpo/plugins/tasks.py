"""Task plugins, symmetric with reward plugins: a task is one module in `data/` (or in a folder a recipe lists in
`task_dirs`) that declares, at module level:

    NAME = "my_task"                      # what `task:` in a recipe says
    DEFAULT_REWARDS = ["my_reward", ...]  # the rewards when a recipe names none (`reward_funcs`), weight 1 each
    def load(task_args, split, max_pixels) -> datasets.Dataset   # split "train" or "eval": rows with `id`,
        # a conversational `prompt`, `image` (or `images`), and the columns its rewards read
    def score(row, text) -> dict          # evaluation: at least `gold`, `prediction` (None: unparsed), `correct`
    def identity(task_args) -> dict       # what identifies its data in manifests and result files
    # optional:
    @dataclass
    class Options: ...                    # its recipe keys (flat in the YAML, checked like every other key)
    def check(task_args) -> None          # validate its keys before anything loads (raise ValueError)
    EVAL_MAX_NEW_TOKENS = 1024            # evaluation length when not the recipe's `max_completion_length`

Training, SFT, evaluation, the held-out curves and the manifests read all of it from the task, so a new dataset
needs no edit anywhere else. A module that defines `NAME` but misses a required piece fails at load, naming its file.
Task plugins are code: they run with your permissions; only `data/` and the folders you name are imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from vision_grpo.plugins.discovery import import_plugin, plugin_files

BUILTIN_PACKAGE = "vision_grpo.data"
# The `data/` folder: where the package `vision_grpo.data` is installed from (found without importing it).
BUILTIN_DIR = Path(importlib.util.find_spec(BUILTIN_PACKAGE).submodule_search_locations[0]).resolve()
REQUIRED = ("NAME", "DEFAULT_REWARDS", "load", "score", "identity")


class TaskPluginError(RuntimeError):
    """A task module that cannot be loaded, misses a required piece, or is asked for by a name nobody declares."""


@dataclass(frozen=True)
class Task:
    """One registered task: what its module declares, and the file it came from."""

    name: str
    default_rewards: tuple[str, ...]
    load: Callable[[Any, str, int], Any]
    score: Callable[[dict[str, Any], str], dict[str, Any]]
    identity: Callable[[Any], dict[str, Any]]
    check: Callable[[Any], None] | None
    options: type | None
    eval_max_new_tokens: int | None
    source: str


_REGISTRY: dict[str, Task] = {}
_LOADED: set[Path] = set()


def _as_task(module: ModuleType, path: Path) -> Task:
    missing = [piece for piece in REQUIRED if not hasattr(module, piece)]
    if missing:
        raise TaskPluginError(f"task module {path} defines NAME but not {missing}; a task declares all of {REQUIRED}")
    options = getattr(module, "Options", None)
    if options is not None and not dataclasses.is_dataclass(options):
        raise TaskPluginError(f"task module {path}: `Options` must be a dataclass of recipe keys")
    return Task(
        name=module.NAME,
        default_rewards=tuple(module.DEFAULT_REWARDS),
        load=module.load,
        score=module.score,
        identity=module.identity,
        check=getattr(module, "check", None),
        options=options,
        eval_max_new_tokens=getattr(module, "EVAL_MAX_NEW_TOKENS", None),
        source=str(path),
    )


def _register(path: Path) -> None:
    if path in _LOADED:
        return
    module = import_plugin(path, (BUILTIN_DIR, BUILTIN_PACKAGE), TaskPluginError, "task module")
    _LOADED.add(path)
    if not hasattr(module, "NAME"):
        return  # a helper module (a generator, the multimodal collator), not a task
    task = _as_task(module, path)
    existing = _REGISTRY.get(task.name)
    if existing and existing.source != task.source:
        raise TaskPluginError(f"two task modules are named `{task.name}`: {existing.source} and {task.source}")
    _REGISTRY[task.name] = task


def discover(task_dirs: Sequence[str | Path] = ()) -> dict[str, Task]:
    """Import every module of `data/` and of `task_dirs`; return the tasks they declare, by name."""
    for path in plugin_files([BUILTIN_DIR, *map(Path, task_dirs)], TaskPluginError, "task"):
        _register(path)
    return dict(_REGISTRY)


def get_task(name: str, task_dirs: Sequence[str | Path] = ()) -> Task:
    """The task a recipe's `task:` names, looked up in `data/` and its `task_dirs`."""
    tasks = discover(task_dirs)
    if name not in tasks:
        raise TaskPluginError(f"unknown task `{name}`; available: {sorted(tasks)} (from data/ and task_dirs)")
    return tasks[name]


def task_of(task_args: Any) -> Task:
    """The task of a parsed recipe."""
    return get_task(task_args.task, task_args.task_dirs)
