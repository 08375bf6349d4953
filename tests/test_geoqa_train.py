"""GeoQA recipes: every one parses with consistent batch arithmetic, the seed's settings are the seed's, and the tiny
recipe trains on the fixture through the real entry point and logs the accuracy and format-rate curves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, run_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trl import GRPOConfig, ModelConfig

from vision_grpo.data.geoqa_fixture import write_fixture
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.rewards import get_reward_funcs

RECIPES = sorted((REPO / "recipes" / "geoqa").glob("*.yaml"))
GPU_RECIPES = {
    "qwen3_5_4b_lora.yaml": "Qwen/Qwen3.5-4B",
    "qwen2_5_vl_3b_lora.yaml": "Qwen/Qwen2.5-VL-3B-Instruct",
    "qwen3_vl_4b_lora.yaml": "Qwen/Qwen3-VL-4B-Instruct",
}


def parse(recipe: Path) -> tuple[TaskArguments, GRPOConfig, ModelConfig]:
    # GRPOConfig refuses bf16 on a machine without a GPU, so GPU recipes are parsed here with `--bf16 false`; every
    # other value is the recipe's own.
    overrides = ["--bf16", "false"] if recipe.name in GPU_RECIPES else []
    return parse_recipe((TaskArguments, GRPOConfig, ModelConfig), ["--config", str(recipe), *overrides])


def test_all_recipes_are_here() -> None:
    assert {p.name for p in RECIPES} == {*GPU_RECIPES, "tiny_cpu.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_batch_arithmetic(recipe: Path) -> None:
    task, train, model = parse(recipe)
    assert task.task == "geoqa"
    assert train.generation_batch_size % train.num_generations == 0
    # One generation batch per optimizer step, as in the seed: rollouts come from the policy being updated.
    assert train.steps_per_generation == train.gradient_accumulation_steps
    assert train.generation_batch_size == train.per_device_train_batch_size * train.gradient_accumulation_steps
    assert train.max_steps > 0 and train.save_steps > 0 and train.logging_steps == 1
    assert len(get_reward_funcs(task.reward_funcs)) == len(train.reward_weights)
    weights = dict(zip(task.reward_funcs, train.reward_weights, strict=True))
    assert weights == {"boxed_option": 1.0, "boxed_option_format": 0.0}  # format rate logged, not rewarded
    assert train.beta == 0.0 and train.scale_rewards == "none" and train.loss_type == "dr_grpo"
    # No thinking (the seed's run). `enable_thinking` only where the template has the switch (Qwen3.5): passed to
    # Qwen2.5-VL's template, transformers warned about it on every prompt (336 of 360 log lines of the tiny run).
    assert (train.chat_template_kwargs or {}).get("enable_thinking", False) is False
    assert model.use_peft and task.vision_tower == "freeze"


@pytest.mark.parametrize("recipe", [p for p in RECIPES if p.name in GPU_RECIPES], ids=lambda p: p.name)
def test_gpu_recipes_are_the_seeds_run(recipe: Path) -> None:
    task, train, model = parse(recipe)
    assert model.model_name_or_path == GPU_RECIPES[recipe.name] and model.lora_r == 32
    assert train.generation_batch_size // train.num_generations == 8 and train.num_generations == 8
    assert (train.max_steps, train.save_steps, train.max_completion_length) == (100, 25, 1024)
    assert (train.learning_rate, train.temperature, train.top_p) == (4e-5, 1.0, 1.0)
    assert task.dataset_name == "hz2475/geoQA" and task.dataset_revision and task.geoqa_test_rows == 759
    assert task.prompt_language == "zh"


def test_tiny_recipe_reads_a_local_fixture_and_checks_every_prompt() -> None:
    task, train, _ = parse(REPO / "recipes" / "geoqa" / "tiny_cpu.yaml")
    assert task.dataset_name.endswith(".parquet") and task.token_check_samples == -1
    assert train.use_cpu and train.max_completion_length <= 32


@pytest.mark.slow
def test_tiny_recipe_trains_and_logs_accuracy_and_format_rate(tmp_path: Path) -> None:
    fixture = write_fixture(tmp_path / "geoqa.parquet", train_rows=64)
    args = ["recipes/train.py", "--config", "recipes/geoqa/tiny_cpu.yaml", "--dataset_name", str(fixture)]
    run_script([*args, "--output_dir", str(tmp_path / "runs"), "--run_name", "smoke", "--max_steps", "2"], timeout=600)

    events = EventAccumulator(str(tmp_path / "runs" / "smoke"))
    events.Reload()
    scalars = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    accuracy = scalars["train/rewards/boxed_option/mean"]
    format_rate = scalars["train/rewards/boxed_option_format/mean"]
    degenerate = scalars["train/frac_reward_zero_std"]  # our `degenerate_fraction`: groups with equal rewards
    assert len(accuracy) == len(format_rate) == len(degenerate) == 2
    assert all(0.0 <= a <= f <= 1.0 for a, f in zip(accuracy, format_rate, strict=True))
    assert all(0.0 <= d <= 1.0 for d in degenerate)
    assert (tmp_path / "runs" / "smoke" / "adapter_model.safetensors").exists()
    manifest = json.loads((tmp_path / "runs" / "smoke" / "manifest.json").read_text())
    assert manifest["rows_unused"] == {"train": {"val (unused by the seed)": 40}}  # the fixture's val rows
