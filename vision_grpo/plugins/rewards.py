"""The reward registry behind `rewards/`: one per process, whether plugins import `vision_grpo.rewards` or, from
the repository root, `rewards` (both names re-export this module, so they share it).

What a plugin file looks like, and the contract of a reward function, is in `rewards/__init__.py`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vision_grpo.plugins.discovery import ENDS_THE_RUN, ended, import_plugin, plugin_files
from vision_grpo.plugins.reward_calls import StopRequested, reward_call
from vision_grpo.plugins.reward_faults import FAIL, FaultPolicy, call_faults, describe
from vision_grpo.plugins.reward_rounds import RewardRound

logger = logging.getLogger(__name__)
RewardFunc = Callable[..., list[float | None]]
# The `rewards/` folder: where the package `vision_grpo.rewards` is installed from (found without importing it).
BUILTIN_DIR = Path(importlib.util.find_spec("vision_grpo.rewards").submodule_search_locations[0]).resolve()


class RewardPluginError(RuntimeError):
    """A reward plugin that cannot be loaded or returned something unusable."""


RewardPluginError.__module__ = "vision_grpo.rewards"  # where users import it from, and what a traceback shows


@dataclass(frozen=True)
class RegisteredReward:
    name: str
    func: RewardFunc
    source: str


_REGISTRY: dict[str, RegisteredReward] = {}
_LOADED_FILES: set[Path] = set()


def reward(name: str | None = None) -> Callable[[RewardFunc], RewardFunc]:
    """Register the decorated function as reward `name` (default: the function's name)."""

    def register(func: RewardFunc) -> RewardFunc:
        key = name or func.__name__
        source = inspect.getsourcefile(func) or func.__module__
        existing = _REGISTRY.get(key)
        if existing and (existing.source, existing.func.__qualname__) != (source, func.__qualname__):
            raise RewardPluginError(f"two reward plugins are named `{key}`: {existing.source} and {source}")
        _REGISTRY[key] = RegisteredReward(key, func, source)
        return func

    return register


def completion_texts(completions: Sequence[Any]) -> list[str]:
    """The text of each completion, whether TRL passed chat messages or plain strings."""
    texts = []
    for completion in completions:
        if isinstance(completion, str):
            texts.append(completion)
        else:
            texts.append("".join(str(message.get("content") or "") for message in completion))
    return texts


def was_cut_off(ids: Sequence[int] | None, eos_token_ids: Sequence[int] | None) -> bool:
    """True when a completion ended without an EOS token, i.e. it hit the length limit."""
    if ids is None or eos_token_ids is None:
        return False
    return len(ids) == 0 or ids[-1] not in eos_token_ids


def _import_file(path: Path) -> None:
    if path not in _LOADED_FILES:
        import_plugin(path, (BUILTIN_DIR, "vision_grpo.rewards"), RewardPluginError, "reward plugin")
        _LOADED_FILES.add(path)


def discover(extra_dirs: Sequence[str | Path] = ()) -> dict[str, RegisteredReward]:
    """Import every plugin file of this folder and of `extra_dirs`; return the registry. A file that fails to
    import is an error naming it."""
    registry, broken = _discover(extra_dirs)
    if broken:
        raise broken[0]
    return registry


def _discover(extra_dirs: Sequence[str | Path]) -> tuple[dict[str, RegisteredReward], list[RewardPluginError]]:
    """The registry after importing every plugin file that imports, and the errors of those that do not."""
    broken = []
    for path in plugin_files([BUILTIN_DIR, *map(Path, extra_dirs)], RewardPluginError, "reward"):
        try:
            _import_file(path)
        except RewardPluginError as error:
            if error.__cause__ is None:  # not a file failing to import (e.g. two plugins of one name): always fatal
                raise
            broken.append(error)
    return dict(_REGISTRY), broken


def _checked(
    entry: RegisteredReward, context: dict[str, Any], scoring: RewardRound, position: int, policy: FaultPolicy
) -> RewardFunc:
    """Wrap a plugin so that a fault (it raises, returns something unusable or takes too long) fails loudly with the
    plugin's name and file, the row and the value, or with `policy.skip` leaves those completions unscored and
    counted; and so that a completion that none of the recipe's rewards scored (`scoring`, where this reward is at
    `position`) fails with the rewards and rows."""
    accepted = inspect.signature(entry.func).parameters
    bound = {key: value for key, value in context.items() if key in accepted}
    func = functools.partial(entry.func, **bound) if bound else entry.func
    where = f"reward `{entry.name}` ({entry.source})"

    def call(completions: Sequence[Any], columns: dict[str, Any]) -> Any:
        with reward_call(entry.name):
            return func(completions=own_copy(completions), **{key: own_copy(v) for key, v in columns.items()})

    def checked(completions, **kwargs) -> list[float | None]:
        try:
            values, faults = call_faults(call, completions, kwargs, policy.timeout)
        except StopRequested:
            raise
        except ENDS_THE_RUN as error:  # never skipped: the plugin tried to end the process
            raise RewardPluginError(f"{where} {ended(error)}") from error
        if faults:
            said = describe(faults, kwargs.get("id"), len(completions))
            if not policy.skip:
                raise RewardPluginError(
                    f"{where} {said}. Fix the plugin, or set `reward_faults: skip` in the recipe to skip such "
                    "completions (no reward, no advantage) and count them"
                ) from faults[0].error
            logger.warning("%s %s: skipped (reward_faults: skip)", where, said)
        faulty = {i for fault in faults for i in ([fault.index] if fault.index is not None else range(len(values)))}
        if unscored := scoring.add(position, values, kwargs, skipped=[i in faulty for i in range(len(values))]):
            raise RewardPluginError(unscored)
        return values

    checked.__name__ = entry.name  # TRL logs `rewards/<__name__>/mean`
    checked.__qualname__ = entry.name
    checked.reward_round = scoring  # the trainer reads the skipped completions of each scoring from it
    return checked


def own_copy(value: Any) -> Any:
    """`value` with every list, tuple and dict copied, all the way down: TRL hands every reward the same objects, so
    a plugin that edits a completion in place would change what the rewards after it read. Other objects (strings,
    numbers, images, the trainer state) are shared; strings and numbers cannot be edited in place."""
    if isinstance(value, list):
        return [own_copy(item) for item in value]
    if isinstance(value, tuple):
        return tuple(own_copy(item) for item in value)
    if isinstance(value, dict):
        return {key: own_copy(item) for key, item in value.items()}
    return value


def get_reward_funcs(
    names: Sequence[str],
    extra_dirs: Sequence[str | Path] = (),
    context: dict[str, Any] | None = None,
    policy: FaultPolicy = FAIL,
) -> list[RewardFunc]:
    """The checked reward functions for `names`, in order; `context` values are bound where a plugin asks; `policy`
    says what a fault of a plugin does (default: it stops the caller)."""
    registry, broken = _discover(extra_dirs)
    missing = [name for name in names if name not in registry]
    if missing and broken:  # the missing reward may be in a file that did not import: say which
        raise RewardPluginError(
            f"unknown reward(s) {missing}, and {len(broken)} plugin file(s) failed to import: "
            + "; ".join(map(str, broken))
        )
    if missing:
        raise RewardPluginError(f"unknown reward(s) {missing}; available: {sorted(registry)}")
    for error in broken:  # a broken file this run does not need must not stop it, nor pass unseen
        logger.warning("%s; this run does not use it and goes on", error)
    scoring = RewardRound([f"`{name}` ({registry[name].source})" for name in names])
    return [_checked(registry[name], context or {}, scoring, i, policy) for i, name in enumerate(names)]


def reward_sources(names: Sequence[str], extra_dirs: Sequence[str | Path] = ()) -> dict[str, str]:
    """The file each reward of `names` is defined in (an unknown name is left out: loading the rewards names it)."""
    registry, _ = _discover(extra_dirs)
    return {name: registry[name].source for name in names if name in registry}


def get_recipe_rewards(task_args: Any, tokenizer: Any) -> list[RewardFunc]:
    """A recipe's `reward_funcs` with the context they may ask for: one function, so that training, evaluation and
    the held-out curves score completions identically (EOS ids decide which completions were cut off)."""
    eos_token_ids = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    policy = FaultPolicy(skip=task_args.reward_faults == "skip", timeout=task_args.reward_timeout)
    return get_reward_funcs(task_args.reward_funcs, task_args.reward_dirs, {"eos_token_ids": eos_token_ids}, policy)
