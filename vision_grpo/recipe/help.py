"""`--help` for the recipe entry points (`recipes/train.py`, `recipes/sft.py`, `eval/evaluate.py`).

TrlParser's own help prints every field of TRL's trainer config, about 1,400 lines in which our task keys are hard
to find. Ours lists our keys first, in groups (task, model, GRPO/SFT, evaluation), and only the trainer keys a
recipe usually sets; `--help_all` prints TrlParser's full list.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path
from typing import Any

from transformers import TrainingArguments

HELP_FLAGS = ("-h", "--help")
HELP_ALL = "--help_all"
# The trainer-config keys our recipes set or a newcomer reaches for first; a key the class lacks is skipped, so one
# list serves GRPOConfig and SFTConfig.
MAIN_TRAINER_KEYS = (
    "output_dir",
    "run_name",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "num_generations",
    "generation_batch_size",
    "max_completion_length",
    "temperature",
    "top_p",
    "beta",
    "loss_type",
    "scale_rewards",
    "reward_weights",
    "mask_truncated_completions",
    "chat_template_kwargs",
    "use_vllm",
    "vllm_mode",
    "max_length",
    "logging_steps",
    "save_steps",
    "save_strategy",
    "save_total_limit",
    "resume_from_checkpoint",
    "report_to",
    "seed",
    "bf16",
    "use_cpu",
    "activation_checkpointing",
)
GROUP_TITLES = {"TaskArguments": "task", "ModelConfig": "model", "EvalArguments": "evaluation"}


def _group_order(cls: type) -> int:
    """Task, model, trainer (GRPO or SFT), then anything else (the evaluator's options)."""
    if issubclass(cls, TrainingArguments):
        return 2
    return {"TaskArguments": 0, "ModelConfig": 1}.get(cls.__name__, 3)


def _title(cls: type) -> str:
    if issubclass(cls, TrainingArguments):
        total = len(dataclasses.fields(cls))
        kind = cls.__name__.removesuffix("Config")
        return f"{kind} ({cls.__name__}: main keys; {HELP_ALL} lists all {total})"
    return GROUP_TITLES.get(cls.__name__, cls.__name__)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _short_help(f: dataclasses.Field) -> str:
    """The first sentence of a field's help, with its default; `%` escaped for argparse."""
    text = " ".join(str(f.metadata.get("help", "")).split())
    sentence = text.split(". ")[0].rstrip(".")
    return f"{sentence} (default: {_default(f)!r})".replace("%", "%%")


def _formatter(prog: str) -> argparse.HelpFormatter:
    """Keys in a column wide enough for the longest names; the terminal's width, 120 when not a terminal."""
    width = shutil.get_terminal_size((120, 24)).columns
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32, width=width)


def recipe_help(config_classes: tuple[type, ...], prog: str, description: str | None) -> str:
    """The grouped help text of an entry point whose recipe fills `config_classes`."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s --config RECIPE.yaml [--key value ...]",
        description=description,
        epilog="Every key can be set in the recipe or overridden on the command line (`--learning_rate 1e-5`); "
        "lists take several values (`--reward_funcs a b`).",
        formatter_class=_formatter,
        add_help=False,
    )
    general = parser.add_argument_group("recipe")
    general.add_argument("--config", metavar="RECIPE.yaml", help="The recipe file (YAML keys = the keys below).")
    general.add_argument(*HELP_FLAGS, action="store_true", help="This list.")
    general.add_argument(HELP_ALL, action="store_true", help="Every key, TRL's full list.")
    for cls in sorted(config_classes, key=_group_order):
        group = parser.add_argument_group(_title(cls))
        fields = dataclasses.fields(cls)
        if issubclass(cls, TrainingArguments):
            fields = [f for f in fields if f.name in MAIN_TRAINER_KEYS]
        for f in fields:
            group.add_argument(f"--{f.name}", metavar="", help=_short_help(f))
    return parser.format_help()


def exit_with_help(argv: list[str], config_classes: tuple[type, ...], full_parser: argparse.ArgumentParser) -> None:
    """Print the help asked for in `argv` (if any) and exit 0; return when no help was asked for."""
    if HELP_ALL in argv:
        full_parser.print_help()
        sys.exit(0)
    if any(flag in argv for flag in HELP_FLAGS):
        # The running script's docstring says what it does; `python -m pytest` or an embedding program has its own.
        description = getattr(sys.modules.get("__main__"), "__doc__", None)
        print(recipe_help(config_classes, Path(sys.argv[0]).name, description))
        sys.exit(0)
