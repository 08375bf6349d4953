"""Recipe parsing: one YAML file, three dataclasses (ours, TRL's trainer config, TRL's `ModelConfig`).

The recipe is read once (`read_recipe`), its keys checked against the three dataclasses (a typo fails at once with
the nearest valid key instead of somewhere in the middle), then `TrlParser` builds the dataclasses: the recipe's
values as defaults, the command line's flags over them; TRL's `env:` block is set as TrlParser sets it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import itertools
import math
import os
import sys
import types
import typing
import unicodedata
from pathlib import Path
from typing import Any

import yaml
from trl import TrlParser

from vision_grpo.plugins.tasks import TaskPluginError
from vision_grpo.recipe.arguments import RecipeError, TaskArguments, arguments_class
from vision_grpo.recipe.bounds import ABOVE_ZERO, LOWER_BOUNDS, UPPER_BOUNDS, bound_error
from vision_grpo.recipe.help import exit_with_help


def _field_types(config_classes: tuple[type, ...]) -> dict[str, Any]:
    """Every field name of `config_classes` with its resolved annotation (the first class wins)."""
    found: dict[str, Any] = {}
    for cls in config_classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            found.setdefault(f.name, hints.get(f.name, Any))
    return found


def _matches(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a field's annotation.

    TrlParser hands YAML values to argparse as defaults, and argparse only converts (and checks) strings: without
    this check `max_steps: 2.5`, `use_peft: 3` or `save_strategy: no` (YAML reads a boolean) pass silently.
    Strings pass here for the same reason (enums too take their strings); other annotations are left to the trainer.
    """
    if isinstance(value, str) or hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple) or hint in (list, tuple):
        return isinstance(value, list) and all(_matches(item, args[0] if args else Any) for item in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is type(None):
        return value is None
    if hint in (int, float):  # a YAML integer is a valid float; a boolean is neither
        return not isinstance(value, bool) and isinstance(value, int if hint is int else (int, float))
    if hint in (bool, str) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return isinstance(value, hint)
    return True


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: PyYAML silently keeps the last
    one, so a recipe that sets `learning_rate` twice trained with whichever came last, without a word."""


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    lines: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: merged keys may be overridden, not duplicates
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in lines:
            raise yaml.constructor.ConstructorError(
                None, None, f"key `{key}` is set twice (lines {lines[key]} and {line}); keep one", key_node.start_mark
            )
        lines[key] = line
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def read_recipe(path: str | Path) -> Any:
    """A recipe file's YAML content. Every reader of a recipe goes through here, so a `--config` that is missing, a
    folder or a binary file (a checkpoint or an image passed by mistake) is named in one line, not met as an
    `IsADirectoryError` or `UnicodeDecodeError` traceback."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(path.glob("*.y*ml"))
        which = f", e.g. `--config {inside[0]}`" if inside else ""
        raise RecipeError(f"recipe {path} is a folder, not a recipe file: pass a .yaml file to --config{which}")
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist: check the path given to --config")
    data = path.read_bytes()
    if _looks_binary(data):
        raise RecipeError(f"recipe {path} is a binary file, not YAML: pass the recipe's .yaml file to --config")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:  # text, in another encoding (Latin-1, cp1252)
        raise RecipeError(
            f"recipe {path} is not UTF-8 text (byte {data[error.start]:#04x} at offset {error.start}): save it as UTF-8"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a safe loader
    except yaml.YAMLError as error:
        raise RecipeError(f"recipe {path} is not valid YAML: {error}") from error


def _looks_binary(data: bytes) -> bool:
    """A NUL byte in the first 8 KiB (git's test: images, archives, weights and pickles have one), or more than 1% of
    those bytes control characters, which YAML text never holds (PyYAML refuses even one, naming its position)."""
    head = data[:8192]
    controls = sum(byte < 0x20 and byte not in b"\t\n\r" or byte == 0x7F for byte in head)
    return b"\0" in head or controls > len(head) / 100


def shown_key(key: Any) -> str:
    """A key or flag as an error shows it: in backticks, or, when it holds characters that do not show or only look
    like ASCII (a zero-width space, a non-breaking space, a BOM, a Cyrillic `а`), escaped with those characters
    named, so that the user sees why `learning_rate` was unknown."""
    text = str(key)
    if text.isascii() and text.isprintable():
        return f"`{text}`"
    odd = sorted({c for c in text if not (c.isascii() and c.isprintable())})
    names = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}" for c in odd)
    return f"{ascii(text)} (it holds {names}: retype it)"


def check_recipe_keys(path: str | Path, content: dict[str, Any], config_classes: tuple[type, ...]) -> None:
    """Fail on keys of the recipe `path` (its `content`) that none of `config_classes` knows (naming the nearest
    valid key) and on values of the wrong type."""
    known = _field_types(config_classes)
    for key, value in content.items():
        if key == "env":  # TRL's block of environment variables, which TrlParser sets before building the configs
            _check_env_block(path, value)
            continue
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean `{near[0]}`?" if near else ""
            raise RecipeError(f"recipe {path}: unknown key {shown_key(key)}{hint}")
        if not _matches(value, known[key]):
            expected = known[key].__name__ if isinstance(known[key], type) else known[key]
            raise RecipeError(f"recipe {path}: `{key}: {value!r}` has type {type(value).__name__}, expected {expected}")


def _check_env_block(path: str | Path, value: Any) -> None:
    """TRL's `env:` mapping: variable names to scalar values (TrlParser sets each with `str(value)`)."""
    scalars = (str, int, float, bool)
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, scalars) for k, v in value.items()):
        raise RecipeError(
            f"recipe {path}: `env` must map variable names to values (`env: {{HF_HUB_OFFLINE: 1}}`), got {value!r}"
        )


class _RecipeParser(TrlParser):
    """TrlParser without argparse's prefix matching (`--learning_rat` silently meant `--learning_rate`) and with
    errors raised as `RecipeError` instead of printed usage plus `SystemExit(2)` (which callers saw as a traceback);
    `parse_recipe` adds where the value came from."""

    def __init__(self, config_classes: tuple[type, ...]) -> None:
        super().__init__(config_classes, allow_abbrev=False)

    def error(self, message: str) -> typing.NoReturn:
        raise RecipeError(message)


def check_cli_flags(argv: list[str], parser: argparse.ArgumentParser) -> None:
    """Fail on a `--flag` that no config field defines, naming the nearest one, as `check_recipe_keys` does for YAML."""
    known = {"--config", *(option for action in parser._actions for option in action.option_strings)}
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            near = difflib.get_close_matches(flag, sorted(o for o in known if "-" not in o[2:]), n=1)
            hint = f"; did you mean `{near[0]}`?" if near else "; `--help` lists the keys"
            raise RecipeError(f"command line: unknown flag {shown_key(flag)}{hint}")


def parse_recipe(
    config_classes: tuple[type, ...], argv: list[str] | None = None, also_read_by: tuple[type, ...] = ()
) -> tuple[Any, ...]:
    """Parse `--config recipe.yaml` plus CLI overrides into one instance of each of `config_classes`.

    Training passes (TaskArguments, GRPOConfig or SFTConfig, ModelConfig); the evaluator adds its own dataclass, so
    it reads the very recipe training used and every field stays overridable on the command line. Keys that only
    the classes `also_read_by` know (the evaluator passes SFTConfig: it reads SFT recipes too) are checked like the
    others and left out. `--help` prints our keys, grouped, and exits 0 (`--help_all`: TRL's full list).
    """
    argv = sys.argv[1:] if argv is None else argv
    path = recipe_path_of(argv)
    recipe = read_recipe(path) if path is not None else {}
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe {path} must be a mapping of keys to values, got {type(recipe).__name__}")
    config_classes = _with_plugin_task_keys(config_classes, argv, recipe)
    parser = _RecipeParser(config_classes)
    exit_with_help(argv, config_classes, parser)
    check_cli_flags(argv, parser)
    check_recipe_keys(path, recipe, (*config_classes, *also_read_by))
    _checkpointing_default_under_its_current_name(parser, config_classes, {*recipe, *argv})
    where = f"recipe {path}" if path is not None else "command line"
    for name, value in recipe.get("env", {}).items():  # TRL's `env:` block, set as TrlParser sets it
        os.environ[name] = str(value)
    flags = argv[: argv.index("--config")] + argv[argv.index("--config") + 2 :] if path is not None else argv
    try:
        known = {field.name for cls in config_classes for field in dataclasses.fields(cls)}
        parser.set_defaults_with_config(**{key: value for key, value in recipe.items() if key in known})
        parsed = tuple(parser.parse_args_into_dataclasses(args=flags))
    except ValueError as error:  # argparse's, our checks', or a trainer config's own (GRPOConfig's batch arithmetic)
        raise RecipeError(f"{where}: {error}") from None
    _check_reward_weights(parsed, where)
    _check_lower_bounds(parsed, where)
    return parsed


def _checkpointing_default_under_its_current_name(
    parser: argparse.ArgumentParser, config_classes: tuple[type, ...], given: set[str]
) -> None:
    """TRL's trainer configs turn checkpointing on by default under transformers' deprecated name,
    `gradient_checkpointing`, so every config built from them warned; the same default goes under the current name,
    `activation_checkpointing`, instead. A recipe or flag that names the old key keeps transformers' handling of it
    (its value applies, with transformers' warning about the user's key)."""
    if {"gradient_checkpointing", "--gradient_checkpointing"} & {key.split("=", 1)[0] for key in given}:
        return
    for cls in config_classes:
        fields = {field.name: field for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        old, new = fields.get("gradient_checkpointing"), fields.get("activation_checkpointing")
        if old and new and new.default is None and old.default is not None:
            parser.set_defaults(activation_checkpointing=old.default, gradient_checkpointing=None)


def _with_plugin_task_keys(
    config_classes: tuple[type, ...], argv: list[str], recipe: dict[str, Any]
) -> tuple[type, ...]:
    """`config_classes` with `TaskArguments` extended by the keys of the task plugins in the recipe's `task_dirs`
    (the command line's `--task_dirs` wins over the YAML's), so a plugin's keys are checked like every other key."""
    if TaskArguments not in config_classes:
        return config_classes
    dirs: list[str] = []
    if "--task_dirs" in argv:
        following = argv[argv.index("--task_dirs") + 1 :]
        dirs = list(itertools.takewhile(lambda arg: not arg.startswith("--"), following))
    else:
        dirs = list(recipe.get("task_dirs") or [])
    if not dirs:
        return config_classes
    try:
        extended = arguments_class(tuple(str(Path(d).resolve()) for d in dirs))
    except TaskPluginError as error:
        raise RecipeError(str(error)) from None
    return tuple(extended if cls is TaskArguments else cls for cls in config_classes)


def _check_reward_weights(parsed: tuple[Any, ...], where: str) -> None:
    """One weight per reward, checked here rather than by TRL after the model has loaded."""
    funcs = next((c.reward_funcs for c in parsed if hasattr(c, "reward_funcs")), None)
    weights = next((c.reward_weights for c in parsed if getattr(c, "reward_weights", None) is not None), None)
    if funcs is not None and weights is not None and len(weights) != len(funcs):
        raise RecipeError(
            f"{where}: reward_weights has {len(weights)} values {list(weights)} but reward_funcs names "
            f"{len(funcs)} rewards {list(funcs)}; give one weight per reward"
        )


def _check_lower_bounds(parsed: tuple[Any, ...], where: str) -> None:
    """Every key of the bounds table (vision_grpo/recipe/bounds.py) within its bounds, finite, and no NaN anywhere."""
    bounded = (*LOWER_BOUNDS, *UPPER_BOUNDS, *ABOVE_ZERO)
    for config in parsed:
        for f in dataclasses.fields(config):
            value = getattr(config, f.name, None)
            if isinstance(value, float) and not math.isfinite(value) and f.name in bounded:
                raise RecipeError(f"{where}: {f.name} must be a finite number, got {value}")
            if isinstance(value, float) and math.isnan(value):
                raise RecipeError(f"{where}: {f.name} must be a number, got {value}")
        for key in bounded:
            value = getattr(config, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and (error := bound_error(key, value)):
                raise RecipeError(f"{where}: {error}")
        low, high = getattr(config, "min_pixels", None), getattr(config, "max_pixels", None)
        if low is not None and high is not None and low > high:
            raise RecipeError(f"{where}: min_pixels ({low:,}) is above max_pixels ({high:,}); set min_pixels lower")


def recipe_path_of(argv: list[str]) -> str | None:
    """The `--config` file of an argument list, if any."""
    if "--config" not in argv:
        return None
    index = argv.index("--config") + 1
    if index == len(argv) or argv[index].startswith("--"):
        raise RecipeError("command line: `--config` needs a recipe file, e.g. `--config recipes/shapes/tiny_cpu.yaml`")
    return argv[index]
