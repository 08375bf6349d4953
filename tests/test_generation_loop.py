"""One generation loop: the evaluator, the held-out curve and pass@k read their batches and generate through the
evaluator's `read_batch` and `generate`, so multi-image rows (a list-of-images column) work in all three."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.vqa_fixtures import write_fixtures
from vision_grpo.evaluation import evaluate, pass_at_k
from vision_grpo.evaluation.batches import read_batch
from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.rewards import get_recipe_rewards
from vision_grpo.training.holdout import HoldoutAccuracy

MULTI_IMAGE_RECIPES = ["recipes/vqa/tiny_two_image.yaml", "recipes/vqa/tiny_geometry3k.yaml"]


@pytest.fixture(scope="module")
def vqa_fixtures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixtures(tmp_path_factory.mktemp("vqa"))


def recipe_args(recipe: str, fixtures: Path) -> list[str]:
    """The recipe with its `.cache/vqa/<name>` dataset pointed at this test's fixtures."""
    line = next(line for line in Path(recipe).read_text().splitlines() if line.startswith("dataset_name:"))
    name = Path(line.split(":", 1)[1].split("#")[0].strip()).name
    return ["--config", recipe, "--dataset_name", str(fixtures / name)]


@pytest.mark.parametrize("recipe", MULTI_IMAGE_RECIPES)
def test_pass_at_k_samples_multi_image_rows(recipe: str, vqa_fixtures: Path, tmp_path: Path) -> None:
    args = [*recipe_args(recipe, vqa_fixtures), "--limit", "3", "--batch_size", "2", "--max_new_tokens", "3"]
    result = pass_at_k.main([*args, "--k", "2", "--output", str(tmp_path / "pass.json")])
    task_args, _, model_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), recipe_args(recipe, vqa_fixtures))
    rows = get_dataset(task_args, "eval", max_pixels_of(get_processor(model_args, task_args)))
    assert all(isinstance(row["images"], list) for row in rows.select(range(3)))
    assert [r["id"] for r in result["records"]] == rows["id"][:3]
    assert all(len(r["texts"]) == len(r["correct"]) == 2 for r in result["records"])
    assert json.loads((tmp_path / "pass.json").read_text())["summary"]["n"] == 3


@pytest.mark.parametrize("recipe", MULTI_IMAGE_RECIPES)
def test_the_holdout_curve_measures_multi_image_rows_as_the_evaluator_does(
    recipe: str, vqa_fixtures: Path, tmp_path: Path
) -> None:
    """The curve's metrics on the first rows are those of `eval/evaluate.py` on the same rows (dataset order)."""
    args = recipe_args(recipe, vqa_fixtures)
    task_args, train_args, model_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), args)
    processor = get_processor(model_args, task_args)
    rows = get_dataset(task_args, "eval", max_pixels_of(processor)).select(range(3))
    rewards = get_recipe_rewards(task_args, processor.tokenizer)
    trainer_args = SimpleNamespace(chat_template_kwargs=None, per_device_eval_batch_size=2)
    trainer = SimpleNamespace(model=load_model(model_args), processing_class=processor, args=trainer_args)
    metrics = HoldoutAccuracy(trainer, rows, task_args.task, rewards, every=1, max_new_tokens=3).measure()

    evaluated = evaluate.main(
        [*args, "--limit", "3", "--max_new_tokens", "3", "--bucket_by_length", "false", "--output", str(tmp_path / "e")]
    )["summary"]
    for key in ("accuracy", "format_rate", "mean_completion_tokens", "hit_limit_rate", "distinct_output_rate"):
        assert metrics[key] == pytest.approx(evaluated[key]), key
    assert {f"rewards/{name}" for name in evaluated["rewards"]} <= set(metrics)


def test_controls_are_built_per_batch_from_the_rows_read() -> None:
    """`blank`: white canvases of each image's size (every image of a list); `shuffled`: the next row's images."""
    images = [[Image.new("RGB", (20 + i, 30), (i, 0, 0)), Image.new("RGB", (9, 9 + i), (0, i, 0))] for i in range(4)]
    dataset = {"id": ["a", "b", "c", "d"], "images": images}

    class Rows:  # what `read_batch` needs of a dataset: batch reads by indices, and a length
        def __len__(self) -> int:
            return 4

        def __getitem__(self, indices: list[int]) -> dict[str, list]:
            return {key: [values[i] for i in indices] for key, values in dataset.items()}

    rows, shown = read_batch(Rows(), [1, 3], "none")
    assert [row["id"] for row in rows] == ["b", "d"] and shown == [images[1], images[3]]
    _, blank = read_batch(Rows(), [1, 3], "blank")
    assert [[b.size for b in each] for each in blank] == [[i.size for i in images[n]] for n in (1, 3)]
    assert all(b.getextrema() == ((255, 255),) * 3 for each in blank for b in each)
    _, shuffled = read_batch(Rows(), [1, 3], "shuffled")
    assert shuffled == [images[2], images[0]]
    assert read_batch(Rows(), [], "shuffled") == ([], [])
