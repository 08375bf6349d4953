"""Task plugins: shapes and GeoQA are two tasks of the registry and build exactly the rows they built before it; a new
task is one file, found by name, with its own recipe keys; a task file missing a piece fails at load naming it."""

from __future__ import annotations

import hashlib
import io
import json
import textwrap
import uuid
from pathlib import Path

import pytest
from conftest import run_script
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.geoqa_fixture import write_fixture
from vision_grpo.plugins.tasks import TaskPluginError, discover, get_task
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe

# Digests of ids, prompts, image bytes and reward columns, recorded with the code before tasks became plugins.
BEFORE = {
    ("shapes-mixed", "train"): "8e8acaa0e689ee98",
    ("shapes-mixed", "eval"): "b1e449ecc63f020d",
    ("shapes-single", "train"): "ec1b465d27bb6168",
    ("shapes-single", "eval"): "f1bc50d0e7c653f9",
    ("geoqa", "train"): "3c5aed272a3e173b",
    ("geoqa", "eval"): "87df9e921ace366a",
}
SINGLE = {"shapes_layout": "single", "shapes_canvas": 140, "shapes_max_count": 3, "shapes_fixed_size": True}


def digest(dataset) -> str:
    h = hashlib.sha256()
    for row in dataset:
        h.update(row["id"].encode())
        h.update(json.dumps(row["prompt"], sort_keys=True, ensure_ascii=False).encode())
        buffer = io.BytesIO()
        row["image"].save(buffer, "PNG")
        h.update(buffer.getvalue())
        columns = {k: v for k, v in row.items() if k not in ("id", "prompt", "image")}
        h.update(json.dumps(columns, sort_keys=True).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("split", ["train", "eval"])
def test_shapes_and_geoqa_build_the_rows_they_built_before(split: str, tmp_path: Path) -> None:
    fixture = write_fixture(tmp_path / "geoqa.parquet", train_rows=20)
    cases = {
        "shapes-mixed": (TaskArguments(shapes_train_size=6, shapes_eval_size=4), 168 * 168),
        "shapes-single": (TaskArguments(**SINGLE, shapes_train_size=6, shapes_eval_size=4), 168 * 168),
        "geoqa": (TaskArguments(task="geoqa", dataset_name=str(fixture)), 192 * 192),
    }
    for name, (task_args, max_pixels) in cases.items():
        assert digest(get_dataset(task_args, split, max_pixels)) == BEFORE[(name, split)], name


def test_the_builtin_tasks_are_registered_with_their_pieces() -> None:
    tasks = discover()
    assert {"shapes", "geoqa", "vqa"} <= set(tasks)
    assert tasks["geoqa"].default_rewards == ("boxed_option",)
    assert TaskArguments(task="geoqa").reward_funcs == ["boxed_option"]  # a recipe that names no rewards
    assert TaskArguments(task="shapes").reward_funcs == ["count_correct", "count_description", "count_reasoning"]
    assert tasks["shapes"].source.endswith("data/task_shapes.py")


PLUGIN = '''
"""A test task: {n} white images, "What is this?", the answer `blank`."""

from dataclasses import dataclass

import datasets
from PIL import Image

from vision_grpo.data.prompts_and_images import make_example

NAME = "{name}"
DEFAULT_REWARDS = ["{reward}"]


@dataclass
class Options:
    {name}_size: int = 4


def load(task_args, split, max_pixels):
    rows = [
        make_example(f"{{split}}-{{i}}", "What is this?", Image.new("RGB", (64, 64), "white"), "before_text",
                     max_pixels, answer="blank")
        for i in range(task_args.{name}_size)
    ]
    return datasets.Dataset.from_list(rows)


def score(row, text):
    prediction = text.strip() or None
    return {{"gold": row["answer"], "prediction": prediction, "correct": prediction == row["answer"]}}


def identity(task_args):
    return {{"name": NAME, "size": task_args.{name}_size}}
'''
REWARD = """
from vision_grpo.rewards import completion_texts, reward


@reward()
def {reward}(completions, answer, **kwargs):
    return [float(len(text)) / 10 for text in completion_texts(completions)]
"""


def write_task(folder: Path, *, drop: str | None = None) -> tuple[str, str]:
    """A task plugin (and a reward for it) in `folder`; `drop` removes one required piece."""
    name, reward = f"blank_{uuid.uuid4().hex[:8]}", f"blank_reward_{uuid.uuid4().hex[:8]}"
    source = PLUGIN.format(name=name, reward=reward, n=4)
    if drop:
        source = source.replace(f"\ndef {drop}(", f"\ndef _{drop}(")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    (folder / f"{reward}.py").write_text(REWARD.format(reward=reward))
    return name, reward


def test_a_task_file_missing_a_piece_fails_at_load_naming_its_file(tmp_path: Path) -> None:
    name, _ = write_task(tmp_path / "tasks", drop="score")
    with pytest.raises(TaskPluginError, match=rf"task module .*{name}\.py defines NAME but not \['score'\]"):
        get_task(name, [tmp_path / "tasks"])


def test_an_unknown_task_lists_the_available_ones() -> None:
    with pytest.raises(RecipeError, match=r"unknown task `nope`; available: \[.*'geoqa'.*'shapes'"):
        TaskArguments(task="nope")


def test_a_plugin_tasks_keys_are_recipe_keys_checked_like_the_others(tmp_path: Path) -> None:
    name, reward = write_task(tmp_path / "tasks")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"task: {name}\ntask_dirs: [{tmp_path / 'tasks'}]\n{name}_size: 3\nreward_funcs: [{reward}]\n")
    classes = (TaskArguments, GRPOConfig, ModelConfig)
    task_args, _, _ = parse_recipe(classes, ["--config", str(recipe), "--use_cpu", "true", "--bf16", "false"])
    assert getattr(task_args, f"{name}_size") == 3 and len(get_dataset(task_args, "train", 64 * 64)) == 3
    recipe.write_text(recipe.read_text().replace(f"{name}_size", f"{name}_sise"))
    with pytest.raises(RecipeError, match=rf"unknown key `{name}_sise`; did you mean `{name}_size`"):
        parse_recipe(classes, ["--config", str(recipe)])


@pytest.mark.slow
def test_a_task_file_dropped_into_a_folder_trains_and_evaluates_with_no_other_edit(tmp_path: Path) -> None:
    name, reward = write_task(tmp_path / "plugins")
    plugins = str(tmp_path / "plugins")
    args = ["--config", "recipes/shapes/tiny_cpu.yaml", "--task", name, "--task_dirs", plugins]
    args += ["--reward_dirs", plugins, "--reward_funcs", reward, "--reward_weights", "1", "--max_steps", "2"]
    run_script(["recipes/train.py", *args, "--output_dir", str(tmp_path / "runs"), "--run_name", "r"])
    manifest = json.loads((tmp_path / "runs" / "r" / "manifest.json").read_text())
    assert manifest["task"] == name and manifest["dataset"] == {"name": name, "size": 4}
    output = tmp_path / "eval.json"
    run_script(["eval/evaluate.py", *args, "--adapter", str(tmp_path / "runs" / "r"), "--output", str(output)])
    result = json.loads(output.read_text())
    assert [record["id"] for record in result["records"]] == [f"eval-{i}" for i in range(4)]
    assert result["metadata"]["dataset"] == {"name": name, "size": 4}
