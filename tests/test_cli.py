"""The entry points' command line: `--help` that lists our keys first and exits 0, flags checked like YAML keys."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import run_script
from trl import GRPOConfig, ModelConfig, SFTConfig

from vision_grpo.evaluation.eval_options import EvalArguments
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.run.launched import errors_named_first

GRPO_CLASSES = (TaskArguments, GRPOConfig, ModelConfig)
RECIPE = "recipes/shapes/tiny_cpu.yaml"


def shows_no_chain(error: BaseException) -> bool:
    """What Python prints is this error alone, not "During handling of the above exception ..." first."""
    return error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_train_help_lists_our_groups_first_and_exits_0() -> None:
    process = run_script(["recipes/train.py", "--help"], timeout=120)
    text = process.stdout
    headers = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert headers[:4] == ["recipe:", "task:", "model:", headers[3]] and headers[3].startswith("GRPO (GRPOConfig")
    assert "--shapes_layout" in text and "--lora_r" in text and "--num_generations" in text
    assert "--ddp_backend" not in text  # one of TRL's ~100 other trainer keys: behind --help_all
    assert len(text.splitlines()) < 250  # TrlParser's own help was ~1,400 lines
    assert "Traceback" not in process.stderr


@pytest.mark.parametrize(
    ("classes", "groups"),
    [
        ((TaskArguments, SFTConfig, ModelConfig), ["task:", "model:", "SFT (SFTConfig"]),
        ((TaskArguments, GRPOConfig, ModelConfig, EvalArguments), ["task:", "model:", "GRPO (", "evaluation:"]),
    ],
)
def test_sft_and_evaluator_help_are_grouped(capsys, classes: tuple[type, ...], groups: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe(classes, ["--config", RECIPE, "-h"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    positions = [text.index(f"\n{group}") for group in groups]
    assert positions == sorted(positions)


def test_help_all_is_trls_full_list(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe(GRPO_CLASSES, ["--help_all"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--ddp_backend" in text and len(text.splitlines()) > 1000


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--learning_rat", "unknown flag `--learning_rat`; did you mean `--learning_rate`?"),  # a prefix: no match
        ("--num_generation", "unknown flag `--num_generation`; did you mean `--num_generations`?"),
        ("--shapes_layot", "unknown flag `--shapes_layot`; did you mean `--shapes_layout`?"),
        ("--learning_rat=1e-5", "unknown flag `--learning_rat`; did you mean `--learning_rate`?"),
        ("--zzzzzz", "unknown flag `--zzzzzz`; `--help` lists the keys"),
    ],
)
def test_an_unknown_flag_fails_with_the_nearest_flag(flag: str, message: str) -> None:
    argv = ["--config", RECIPE, flag] + ([] if "=" in flag else ["1e-5"])
    with pytest.raises(RecipeError, match=re.escape(f"command line: {message}")) as error:
        parse_recipe(GRPO_CLASSES, argv)
    assert shows_no_chain(error.value)


def test_a_bad_flag_value_names_the_flag_without_a_chained_traceback() -> None:
    with pytest.raises(
        RecipeError, match=f"recipe {RECIPE}: argument --max_steps.*: invalid int value: 'four'"
    ) as error:
        parse_recipe(GRPO_CLASSES, ["--config", RECIPE, "--max_steps", "four"])
    assert shows_no_chain(error.value)


def test_dashed_and_negated_flags_still_parse() -> None:
    _task, trainer, _model = parse_recipe(
        GRPO_CLASSES, ["--config", RECIPE, "--learning-rate", "3e-5", "--no_shuffle_dataset", "--max_steps=3"]
    )
    assert (trainer.learning_rate, trainer.max_steps, trainer.shuffle_dataset) == (3e-5, 3, False)


def test_config_without_a_file_fails_clearly() -> None:
    with pytest.raises(RecipeError, match="`--config` needs a recipe file"):
        parse_recipe(GRPO_CLASSES, ["--config"])


# ---------------------------------------------------------------------------------------------------------------------
# Under a launcher: the first line names the problem.


def test_under_a_launcher_a_failed_check_is_one_line_first_and_the_root_cause(tmp_path, monkeypatch, capsys) -> None:
    report = tmp_path / "error.json"
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(report))
    with pytest.raises(SystemExit) as stopped, errors_named_first():
        parse_recipe(GRPO_CLASSES, ["--config", RECIPE, "--learning_rat", "1e-3"])
    assert stopped.value.code == 1
    message = "RecipeError: command line: unknown flag `--learning_rat`; did you mean `--learning_rate`?"
    assert capsys.readouterr().err == f"error: {message}\n"
    assert json.loads(report.read_text())["message"] == message  # torch's report shows it as the root cause
    with pytest.raises(KeyError), errors_named_first():  # not a check of ours: its traceback is kept
        {}["missing"]
    assert capsys.readouterr().err == "error: KeyError: 'missing'\n"


def test_without_a_launcher_errors_are_unchanged(monkeypatch) -> None:
    for key in [k for k in os.environ if k == "LOCAL_RANK" or k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    with pytest.raises(RecipeError), errors_named_first():
        parse_recipe(GRPO_CLASSES, ["--config", RECIPE, "--learning_rat", "1e-3"])


@pytest.mark.slow
def test_a_flag_typo_under_accelerate_launch_is_named_by_the_first_line(tmp_path) -> None:
    """The README's two-process command with a typo: before, 70 lines began with a worker's traceback and ended with
    torch's ChildFailedError block, whose root cause said only "To enable traceback see: …"."""
    launch = ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml", "recipes/train.py"]
    args = ["--config", RECIPE, "--learning_rat", "1e-3", "--output_dir", str(tmp_path)]
    failed = run_script([*launch, *args], timeout=300, check=False)
    message = "RecipeError: command line: unknown flag `--learning_rat`; did you mean `--learning_rate`?"
    assert failed.returncode == 1
    assert failed.stderr.splitlines()[0] == f"error: {message}"
    root_cause = failed.stderr.split("Root Cause (first observed failure):")[1]
    assert f"traceback : {message}" in root_cause
    assert failed.stderr.count("Traceback (most recent call last)") == 1  # the launcher's; no worker's
    assert not any(tmp_path.iterdir())
