"""Run one recipe with a few keys swept, as separate runs one after another, then compare them.

    python recipes/sweep.py --config recipes/shapes/tiny_grpo_demo.yaml --learning_rate 2e-5,2e-4 --max_steps 40
    python recipes/sweep.py --launcher "accelerate launch --config_file <file>" --config <recipe> --beta 0,0.04

Several values of a key: one flag, values joined by commas, no spaces, each value once (`--learning_rate
2e-5,6e-5,2e-4`). Several swept flags give every combination. All other flags (any key of recipes/train.py) go to
every run unchanged; all runs' flags are checked before the first starts. Runs are named `<sweep>_<key>=<value>...`
in the recipe's `output_dir`, next to its other runs; afterwards `eval/compare_runs.py` writes the curves and the
table to `--compare_output`.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from trl import GRPOConfig, ModelConfig

from vision_grpo.evaluation.training_curves import write_comparison
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe, read_recipe
from vision_grpo.run.launched import die_with_parent

logger = logging.getLogger("vision_grpo.sweep")
TRAIN = Path(__file__).resolve().with_name("train.py")
Flag = tuple[str, list[str]]


class SweepError(ValueError):
    """A sweep that cannot start: nothing swept, a run name taken, no output folder."""


def split_flags(argv: list[str]) -> list[Flag]:
    """`--key v1 v2 --flag --k=v` as [(key, [v1, v2]), (flag, []), (k, [v])]."""
    flags: list[Flag] = []
    for token in argv:
        if token.startswith("--"):
            key, has_value, value = token[2:].partition("=")
            flags.append((key, [value] if has_value else []))
        elif flags:
            flags[-1][1].append(token)
        else:
            raise SweepError(f"{token!r} is not a --flag or its value")
    return flags


def is_swept(values: list[str]) -> bool:
    """One value with commas, not a JSON object or list (e.g. `--chat_template_kwargs '{"a": 1, "b": 2}'`)."""
    return len(values) == 1 and "," in values[0] and not values[0].lstrip().startswith(("{", "["))


def plan(flags: list[Flag], sweep_name: str) -> list[tuple[str, list[str]]]:
    """(run name, train.py arguments) of every combination of the swept values."""
    fixed = [(key, values) for key, values in flags if not is_swept(values)]
    swept = [(key, [value.strip() for value in values[0].split(",")]) for key, values in flags if is_swept(values)]
    if not swept:
        raise SweepError("nothing to sweep: give at least one flag several values, e.g. --learning_rate 1e-5,4e-5")
    for key, values in swept:
        check_distinct(key, values)
    if any(key == "run_name" for key, _ in flags):
        raise SweepError("the sweep names its runs; use --sweep_name instead of --run_name")
    base = [token for key, values in fixed for token in (f"--{key}", *values)]
    runs = []
    for combination in itertools.product(*(values for _, values in swept)):
        chosen = list(zip((key for key, _ in swept), combination, strict=True))
        name = "_".join([sweep_name, *(f"{key}={value}" for key, value in chosen)])
        name = re.sub(r"[^\w.=+-]", "-", name)  # a readable folder name: no slashes or spaces
        overrides = [token for key, value in chosen for token in (f"--{key}", value)]
        runs.append((name, [*base, *overrides, "--run_name", name]))
    return runs


def check_distinct(key: str, values: list[str]) -> None:
    """Each swept value once, numbers compared as numbers (`1e-4` is `0.0001`): a value given twice would train the
    same run twice, and the second would find the first one's folder taken only after the first had finished."""
    seen: dict[float | str, str] = {}
    for value in values:
        try:
            same: float | str = float(value)
        except ValueError:
            same = value
        if same in seen:
            given = value if seen[same] == value else f"{seen[same]} and {value}, the same number,"
            raise SweepError(f"--{key} gives {given} twice: the runs would repeat each other; give each value once")
        seen[same] = value


def check_runs(runs: list[tuple[str, list[str]]]) -> None:
    """Parse every run's arguments as recipes/train.py will, so a typo fails now, not after the first runs."""
    for _, train_args in runs:
        parse_recipe((TaskArguments, GRPOConfig, ModelConfig), train_args)


def output_dir_of(flags: list[Flag]) -> Path:
    """Where train.py puts the runs: `--output_dir` if given, else the recipe's `output_dir`."""
    values = dict(flags)
    if values.get("output_dir"):
        return Path(values["output_dir"][0])
    if values.get("config"):
        recipe = read_recipe(values["config"][0])  # a mapping: `check_runs` parsed it
        if recipe.get("output_dir"):
            return Path(recipe["output_dir"])
    raise SweepError("no output_dir: set it in the recipe or pass --output_dir")


def run_until_stopped(command: list[str]) -> tuple[int, int | None]:
    """Run one training; a SIGINT or SIGTERM to the sweep is passed on to it once, and no further run starts.

    The run gets its own process group, so a Ctrl-C reaches it only through the sweep (twice would stop it without
    saving), and dies with the sweep (PR_SET_PDEATHSIG) if the sweep is killed. Returns its exit status and the
    signal that stopped the sweep, if any.
    """

    def start_alone() -> None:
        os.setpgid(0, 0)
        die_with_parent()

    child = subprocess.Popen(command, preexec_fn=start_alone)
    stopped_by: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if not stopped_by:  # a second signal goes on as well: the run then stops at once
            stopped_by.append(signum)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait(), (stopped_by[0] if stopped_by else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--sweep_name", default=datetime.now().strftime("%Y%m%d-%H%M%S"), help="Run-name prefix.")
    parser.add_argument("--launcher", help='Default: this Python; e.g. "accelerate launch --config_file <file>".')
    parser.add_argument("--compare_output", help="Comparison files prefix (default: results/sweeps/<sweep_name>).")
    parser.add_argument("--dry_run", action="store_true", help="Print the commands, run nothing.")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    flags = split_flags(rest)
    runs = plan(flags, args.sweep_name)
    check_runs(runs)
    output_dir = output_dir_of(flags)
    taken = [name for name, _ in runs if (output_dir / name).exists()]
    if taken:
        raise SweepError(f"run folders already exist in {output_dir}: {taken}; choose another --sweep_name")
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    run_dirs: list[Path] = []
    for name, train_args in runs:
        command = [*launcher, str(TRAIN), *train_args]
        print(shlex.join(command), flush=True)
        if args.dry_run:
            continue
        exit_code, stopped_by = run_until_stopped(command)
        if stopped_by:
            waiting = [later for later, _ in runs[len(run_dirs) + 1 :]]
            raise SweepError(
                f"stopped by signal {stopped_by} during run {name} (exit {exit_code}): continue it with "
                f"`{shlex.join([*command, '--resume_from_checkpoint', 'last'])}`; not started: {waiting}; finished "
                f"runs: {[str(d) for d in run_dirs]}"
            )
        if exit_code != 0:
            raise SweepError(f"run {name} failed (exit {exit_code}); finished runs: {[str(d) for d in run_dirs]}")
        run_dirs.append(output_dir / name)
    if run_dirs:
        compare_output = args.compare_output or f"results/sweeps/{args.sweep_name}"
        write_comparison([str(d) for d in run_dirs], Path(compare_output))
    return run_dirs


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
