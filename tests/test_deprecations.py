"""No deprecated call of ours: pyproject.toml's `filterwarnings` turns a FutureWarning or DeprecationWarning raised in
a test into an error, and the one it leaves a warning (transformers' `is_gradient_checkpointing`, read by peft's
PeftModel, not by us) is not read by any code of ours either. docs/performance.md lists what the suite still warns
of and where each warning comes from.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import REPO
from trl import GRPOConfig, ModelConfig

from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

ALLOWED_DEPRECATED = "is_gradient_checkpointing"  # pyproject.toml leaves it a warning: peft 0.21 reads it
CLASSES = (TaskArguments, GRPOConfig, ModelConfig)
OUR_CODE = ("vision_grpo", "data", "rewards", "recipes", "eval", "benchmarks", "tests", "tests_vllm", ".ci")


def old_key_recipe(tmp_path: Path) -> str:
    """The tiny recipe with checkpointing (off) under transformers' deprecated name."""
    recipe = yaml.safe_load((REPO / "recipes/shapes/tiny_cpu.yaml").read_text())
    recipe["gradient_checkpointing"] = recipe.pop("activation_checkpointing")
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(recipe))
    return str(tmp_path / "old.yaml")


def test_a_deprecated_key_in_a_recipe_fails_the_test_that_parses_it(tmp_path: Path) -> None:
    """transformers warns from its own module (stacklevel 1), so only a filter on the category, not one on our
    modules' names, sees a deprecation that our call reaches; without pyproject's filter this test fails."""
    with pytest.raises(FutureWarning, match="`gradient_checkpointing` is deprecated"):
        parse_recipe(CLASSES, ["--config", old_key_recipe(tmp_path)])


def test_trls_checkpointing_default_comes_under_its_current_name() -> None:
    """No recipe key: TRL's default (on) applies, without the FutureWarning every GRPOConfig used to raise."""
    _, trainer, _ = parse_recipe(CLASSES, ["--use_cpu", "true"])
    assert (trainer.activation_checkpointing, trainer.gradient_checkpointing) == (True, True)


def test_a_recipe_with_the_old_key_keeps_its_value(tmp_path: Path) -> None:
    with pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated"):
        _, trainer, _ = parse_recipe(CLASSES, ["--config", old_key_recipe(tmp_path)])
    assert (trainer.activation_checkpointing, trainer.gradient_checkpointing) == (False, False)


def test_no_code_of_ours_reads_the_deprecation_left_a_warning() -> None:
    here = Path(__file__).resolve()
    readers = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in OUR_CODE
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != here
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if ALLOWED_DEPRECATED in line
    ]
    assert not readers, f"{readers} read `{ALLOWED_DEPRECATED}`: use `is_activation_checkpointing`"
