"""Every command in the code blocks of the README and of every docs page names a script that exists, and its flags
parse.

Cheap by design: nothing trains or loads a model. Recipe entry points go through `parse_recipe` (the recipe file
must exist and every key and flag must be known), `accelerate launch` through accelerate's own parser (its
`--config_file` must exist), every other script through its `--help`, which must list each flag the README gives.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from accelerate.commands.launch import launch_command_parser
from conftest import REPO
from transformers import TrainingArguments
from trl import GRPOConfig, ModelConfig, SFTConfig

from vision_grpo.evaluation.eval_options import EvalArguments
from vision_grpo.plan.check import recipe_plan
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

RECIPE_SCRIPTS = {
    "recipes/train.py": (TaskArguments, GRPOConfig, ModelConfig),
    "recipes/sft.py": (TaskArguments, SFTConfig, ModelConfig),
    "eval/evaluate.py": (TaskArguments, GRPOConfig, ModelConfig, EvalArguments),
}
# Commands that are not ours (or need a GPU server) are only listed, so that a new kind of command fails the test.
OTHER_PROGRAMS = {"tensorboard", "mkdir", "trl", "pip", "source", "export", "vllm", "curl", "lmms-eval"}
PYTHONS = {"python", "python3", ".venv/bin/python"}
# GPU recipes set `bf16: true`, which TrainingArguments refuses on a machine without a GPU.
CPU_OVERRIDES = ["--bf16", "false", "--use_cpu", "true"]


DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def document_commands(document: Path) -> list[str]:
    """Shell commands of a document's unlabelled code blocks (not ```python / ```yaml), continuations joined."""
    blocks, block, language = [], None, None
    for line in document.read_text(encoding="utf-8").splitlines():
        if line.startswith("```") and block is None:
            block, language = [], line[3:].strip()
        elif line.startswith("```"):
            blocks += ["\n".join(block)] if not language else []
            block = None
        elif block is not None:
            block.append(line)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line.replace("[", " ").replace("]", " "), comments=True)  # `[--key value]`: optional
            while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # `CUDA_VISIBLE_DEVICES=1 ...`
                tokens.pop(0)
            if tokens and tokens[0] not in {"make"} | PYTHONS | OTHER_PROGRAMS | {"accelerate"}:
                continue  # a listing (the layout block), not a command
            if tokens:
                commands.append(shlex.join(tokens))
    return commands


COMMANDS = {document.relative_to(REPO).as_posix(): document_commands(document) for document in DOCUMENTS}
CASES = [(name, command) for name, commands in COMMANDS.items() for command in commands]


def test_the_readme_and_the_docs_have_commands() -> None:
    everything = [command for commands in COMMANDS.values() for command in commands]
    assert any("recipes/train.py" in c for c in COMMANDS["README.md"])
    assert any("compare_runs.py" in c for c in everything)


def _help_text(target: list[str]) -> str:
    """What `python <script or -m module> [positionals] --help` prints, run in this process; exit status 0."""
    out = io.StringIO()
    argv = [target[-1], *(t for t in target[2:] if not t.startswith("-"))] if target[0] == "-m" else target[:1]
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        sys.argv = [*argv, "--help"]
        if target[0] == "-m":
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:  # as `python <script>` runs it: its folder first on sys.path (benchmarks import their common.py)
            script = REPO / target[0]
            with mock.patch.object(sys, "path", [str(script.parent), *sys.path]):
                runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code in (0, None)
    return out.getvalue()


def check_python(args: list[str]) -> None:
    """`args` after `python`: a script or `-m module`, then its arguments."""
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        target = ["-m", module, *[t for t in rest[:1] if not t.startswith("-")]]  # e.g. `geoqa prepare`
    else:
        assert (REPO / args[0]).is_file(), f"{args[0]} does not exist"
        module, rest, target = None, args[1:], [args[0]]
    if module is None and args[0] in RECIPE_SCRIPTS:
        parse_recipe(RECIPE_SCRIPTS[args[0]], [*rest, *CPU_OVERRIDES])
        return
    if module == "vision_grpo.plan":  # its own flags, then any recipe key: parsed (and planned) as the CLI does
        recipe_plan(rest)
        return
    if args[0] == "recipes/sweep.py":
        sweep = runpy.run_path(str(REPO / "recipes" / "sweep.py"))
        own = {"--sweep_name", "--launcher", "--compare_output", "--dry_run"}
        flags = sweep["split_flags"]([t for i, t in enumerate(rest) if t not in own and rest[i - 1] not in own])
        sweep["check_runs"]([(name, [*run, *CPU_OVERRIDES]) for name, run in sweep["plan"](flags, "readme")])
        return
    help_text = _help_text(target if module else [args[0]])
    for flag in (t.split("=")[0] for t in rest if t.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", help_text), f"{flag} is not an option of {target}"


@pytest.mark.parametrize(("document", "command"), CASES, ids=[f"{name}: {command}" for name, command in CASES])
def test_documented_command_names_a_script_that_exists_and_flags_that_parse(
    document: str, command: str, monkeypatch
) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # runpy and the scripts read and set it
    tokens = shlex.split(command)
    if tokens[0] == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(encoding="utf-8"), flags=re.M)
        assert tokens[1] in targets, f"make {tokens[1]}: no such target"
    elif tokens[0] in PYTHONS:
        check_python(tokens[1:])
    elif tokens[:2] == ["accelerate", "launch"]:
        launch = launch_command_parser().parse_args(tokens[2:])
        config = {}
        if launch.config_file:
            assert (REPO / launch.config_file).is_file(), f"{launch.config_file} does not exist"
            config = yaml.safe_load((REPO / launch.config_file).read_text(encoding="utf-8"))
        # The trainer config checks its batch arithmetic against the number of processes the launch starts.
        processes = launch.num_processes or config.get("num_processes", 1)
        monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: processes))
        check_python([launch.training_script, *launch.training_script_args])
    else:
        assert tokens[0] in OTHER_PROGRAMS, f"unknown command {tokens[0]}"


# Commands that refuse an `--output` in a folder that does not exist (the evaluator's): a document makes the folder
# with `mkdir -p` before its first such command, so that its commands run as written on a fresh clone, which has no
# results/. The export, the benchmarks' `--json`, compare_runs and the sweep make theirs.
NEEDS_ITS_FOLDER = {"eval/evaluate.py", "eval/pass_at_k.py"}


@pytest.mark.parametrize("document", sorted(COMMANDS))
def test_a_documented_output_folder_is_made_before_a_command_that_needs_it(document: str) -> None:
    made: set[Path] = set()
    for command in COMMANDS[document]:
        tokens = shlex.split(command)
        if tokens[0] == "mkdir":
            made |= {Path(token) for token in tokens[1:] if not token.startswith("-")}
        if NEEDS_ITS_FOLDER & set(tokens) and "--output" in tokens:
            folder = Path(tokens[tokens.index("--output") + 1]).parent
            if folder != Path(".") and not folder.is_absolute() and "<" not in str(folder):
                assert folder in made, f"{document}: `{command}` writes into {folder}/: `mkdir -p {folder}` first"
