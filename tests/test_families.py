"""Every model family through the real entry points: the GPU recipes on their family's replica (trained, adapter
verified and evaluated), the supervised warm start followed by full fine-tuning, the prompt ids TRL generates from
against the evaluator's, and vision special tokens that a model is pushed to sample.

Each run overrides only what a CPU cannot do without, named where it is passed: `bf16` (no bf16 autocast on CPU),
`use_cpu`, shorter completions and 2 steps (time), the replica and the offline GeoQA fixture instead of the Hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import FAMILY_MODELS, REPO, run_script
from recording.recorder import FORCE_ENV, RECORD_ENV, RECORDING, force_vision_tokens, read_records
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.geoqa_fixture import write_fixture
from vision_grpo.data.vqa_fixtures import write_fixtures
from vision_grpo.evaluation.evaluator import Evaluator
from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
from vision_grpo.models.vision import vision_special_token_ids
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

QWEN2_5, QWEN3_VL, QWEN3_5 = FAMILY_MODELS
# (recipe, replica of the family it names): the seed's Qwen3.5-4B GeoQA run first.
GPU_RECIPES = [
    ("recipes/geoqa/qwen3_5_4b_lora.yaml", QWEN3_5),
    ("recipes/geoqa/qwen2_5_vl_3b_lora.yaml", QWEN2_5),
    ("recipes/shapes/qwen2_5_vl_3b_lora.yaml", QWEN2_5),
    ("recipes/geoqa/qwen3_vl_4b_lora.yaml", QWEN3_VL),
    ("recipes/shapes/qwen3_vl_4b_lora.yaml", QWEN3_VL),
    ("recipes/vqa/qwen2_5_vl_3b_lora.yaml", QWEN2_5),
]
CPU_OVERRIDES = ["--bf16", "false", "--use_cpu", "true"]  # no GPU here: TRL refuses bf16 without one


@pytest.fixture(scope="module")
def geoqa_fixture(tmp_path_factory) -> Path:
    """The offline data of the GPU recipes: the GeoQA-schema parquet, and beside it the VQA fixtures."""
    write_fixtures(tmp_path_factory.getbasetemp() / "families_vqa")
    return write_fixture(tmp_path_factory.mktemp("geoqa") / "geoqa.parquet", train_rows=24)


def data_overrides(recipe: str, fixture: Path) -> list[str]:
    """The offline data in place of the Hub dataset (GeoQA, the VQA fixture of the recipe's schema) or fewer
    generated images (shapes)."""
    if "geoqa" in recipe:
        return ["--dataset_name", str(fixture), "--dataset_revision", ""]
    if "vqa" in recipe:
        geometry3k = fixture.parent.parent / "families_vqa" / "geometry3k"
        return ["--dataset_name", str(geometry3k), "--dataset_revision", ""]
    return ["--shapes_train_size", "16", "--shapes_eval_size", "8"]


@dataclass
class RecipeRun:
    """A GPU recipe trained on its replica and its last checkpoint evaluated; what every generation started from."""

    recipe: str
    replica: str
    run_dir: Path
    evaluation: dict
    generations: list[dict]


def train_and_evaluate(recipe: str, replica: str, fixture: Path, root: Path) -> RecipeRun:
    """`recipe` through the entry point, run unchanged but recorded, with the vision special tokens' logits pushed
    up by +50 (a model that is not prevented from sampling them does); then its checkpoint through eval/evaluate.py.
    Everything else stays the recipe's: LoRA r32, 8 x 8 completions per step in 8 micro-batches, the loss, the
    rewards, the chat-template switches; only the completions are shorter and the run 2 steps long (time)."""
    common = ["--config", recipe, "--model_name_or_path", replica, *data_overrides(recipe, fixture)]
    records = root / "records"
    records.mkdir()
    train = [str(RECORDING / "train_recorded.py"), *common, *CPU_OVERRIDES, "--max_completion_length", "16"]
    train += ["--max_steps", "2", "--save_steps", "1", "--output_dir", str(root / "runs"), "--run_name", "r"]
    run_script(train, timeout=900, env={RECORD_ENV: str(records), FORCE_ENV: "1"})
    run_dir = root / "runs" / "r"
    output = root / "eval.json"
    evaluate = [*common, "--bf16", "false", "--adapter", str(run_dir / "checkpoint-2"), "--limit", "4"]
    run_script(["eval/evaluate.py", *evaluate, "--max_new_tokens", "16", "--output", str(output)], timeout=600)
    evaluation = json.loads(output.read_text())
    return RecipeRun(recipe, replica, run_dir, evaluation, read_records(records, "generation"))


@pytest.fixture(scope="module")
def recipe_run(geoqa_fixture: Path, tmp_path_factory) -> Callable[[str, str], RecipeRun]:
    """Each GPU recipe's run, trained and evaluated once however many tests read it."""
    done: dict[str, RecipeRun] = {}

    def run(recipe: str, replica: str) -> RecipeRun:
        if recipe not in done:
            done[recipe] = train_and_evaluate(recipe, replica, geoqa_fixture, tmp_path_factory.mktemp("recipe"))
        return done[recipe]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "replica"), GPU_RECIPES, ids=[recipe for recipe, _ in GPU_RECIPES])
def test_gpu_recipe_trains_on_its_replica_and_its_adapter_evaluates(recipe: str, replica: str, recipe_run) -> None:
    run = recipe_run(recipe, replica)
    manifest = json.loads((run.run_dir / "manifest.json").read_text())
    assert manifest["ended"] and manifest["global_step"] == 2
    assert (run.run_dir / "adapter_model.safetensors").is_file() and (run.run_dir / "checkpoint-2").is_dir()
    assert run.evaluation["metadata"]["adapter"] == str(run.run_dir / "checkpoint-2")
    records = run.evaluation["records"]
    assert len(records) == 4 and all(0 <= r["completion_tokens"] <= 16 for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("replica", FAMILY_MODELS)
def test_warm_start_then_full_fine_tuning_then_evaluation(replica: str, tmp_path: Path) -> None:
    """The demo's path on each family: SFT (full fine-tuning), GRPO from the SFT model (full), evaluation."""
    small = ["--model_name_or_path", replica, "--shapes_train_size", "16", "--max_steps", "2", "--seed", "1"]
    runs = ["--output_dir", str(tmp_path / "runs")]
    sft = ["recipes/sft.py", "--config", "recipes/shapes/tiny_sft.yaml", *small, *runs, "--run_name", "sft"]
    run_script([*sft, "--per_device_train_batch_size", "8", "--warmup_steps", "0"], timeout=600)
    sft_dir = tmp_path / "runs" / "sft"
    assert (sft_dir / "model.safetensors").is_file() and not (sft_dir / "adapter_config.json").exists()

    grpo = ["recipes/train.py", "--config", "recipes/shapes/tiny_grpo_demo.yaml", *small, *runs, "--run_name", "grpo"]
    grpo[grpo.index(replica)] = str(sft_dir)
    run_script([*grpo, "--per_device_train_batch_size", "16", "--save_strategy", "no"], timeout=600)
    grpo_dir = tmp_path / "runs" / "grpo"
    assert (grpo_dir / "model.safetensors").is_file()

    output = tmp_path / "eval.json"
    evaluate = ["eval/evaluate.py", "--config", "recipes/shapes/tiny_grpo_demo.yaml", "--model_name_or_path"]
    run_script([*evaluate, str(grpo_dir), "--shapes_eval_size", "4", "--output", str(output)], timeout=600)
    assert len(json.loads(output.read_text())["records"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("replica", FAMILY_MODELS)
def test_each_family_trains_and_evaluates_in_bf16_on_cpu(replica: str, tmp_path: Path) -> None:
    """The real models run in bf16: weights loaded in bf16 (no autocast: TRL allows `bf16` only on a GPU), one GRPO
    step with LoRA, then evaluation of the adapter; the evaluator's recorded dtype is the loaded model's."""
    common = ["--config", "recipes/shapes/tiny_cpu.yaml", "--model_name_or_path", replica, "--dtype", "bfloat16"]
    small = ["--shapes_train_size", "4", "--shapes_eval_size", "2", "--max_steps", "1", "--save_strategy", "no"]
    train = [*small, "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8"]
    run_script(["recipes/train.py", *common, *train, "--output_dir", str(tmp_path / "runs"), "--run_name", "r"])
    run_dir = tmp_path / "runs" / "r"
    assert json.loads((run_dir / "manifest.json").read_text())["global_step"] == 1
    output = tmp_path / "eval.json"
    evaluate = [*common, "--adapter", str(run_dir), "--shapes_eval_size", "2", "--max_new_tokens", "8"]
    run_script(["eval/evaluate.py", *evaluate, "--output", str(output)])
    result = json.loads(output.read_text())
    assert result["metadata"]["dtype"] == "bfloat16" and len(result["records"]) == 2


GEOQA_RECIPES = [(recipe, replica) for recipe, replica in GPU_RECIPES if "geoqa" in recipe]


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "replica"), GEOQA_RECIPES, ids=[replica for _, replica in GEOQA_RECIPES])
def test_training_never_samples_a_vision_token_even_when_the_model_prefers_them(recipe, replica, recipe_run) -> None:
    generations = recipe_run(recipe, replica).generations
    processor = get_processor(ModelConfig(model_name_or_path=replica), TaskArguments())
    vision_ids = set(vision_special_token_ids(processor.tokenizer))
    completions = [ids for generation in generations for ids in generation["completion_ids"]]
    assert len(completions) == 2 * 64  # the recipe's 8 questions x 8 completions at each of the 2 steps
    assert not any(vision_ids & set(ids) for ids in completions)


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "replica"), GEOQA_RECIPES, ids=[replica for _, replica in GEOQA_RECIPES])
def test_the_evaluator_generates_from_the_prompt_ids_training_generated_from(
    recipe, replica, recipe_run, geoqa_fixture: Path
) -> None:
    """For each prompt TRL fed the policy, the evaluator builds the very same token ids from the same row."""
    generations = recipe_run(recipe, replica).generations
    argv = ["--config", recipe, "--model_name_or_path", replica, *data_overrides(recipe, geoqa_fixture)]
    task_args, train_args, model_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), [*argv, *CPU_OVERRIDES])
    processor = get_processor(model_args, task_args)
    evaluator = Evaluator(load_model(model_args), processor, "geoqa", [], train_args.chat_template_kwargs or {})
    dataset = get_dataset(task_args, "train", max_pixels_of(processor))
    evaluator_ids = {
        tuple(evaluator.encode([row], [row["image"]])["input_ids"][0].tolist()): row["id"] for row in dataset
    }
    trained = [tuple(ids) for generation in generations for ids in generation["prompt_ids"]]
    assert trained and all(ids in evaluator_ids for ids in trained)
    if replica == QWEN3_5:  # the seed's enable_thinking: false renders the empty think block in both
        empty_think = processor.tokenizer.encode("<think>\n\n</think>\n\n")
        assert all(list(ids[-len(empty_think) :]) == empty_think for ids in trained)


def test_every_gpu_recipe_has_a_replica_run() -> None:
    gpu = {str(p.relative_to(REPO)) for p in REPO.glob("recipes/*/*.yaml") if "tiny" not in p.name}
    covered = {recipe for recipe, _ in GPU_RECIPES}
    assert covered <= gpu
    assert {r for r in gpu if "vllm" not in r} == covered  # the vLLM variants need a vLLM build (issue 14)


@pytest.mark.parametrize("replica", FAMILY_MODELS)
def test_the_evaluator_never_generates_a_vision_token_even_when_the_model_prefers_them(replica: str) -> None:
    args = ModelConfig(model_name_or_path=replica, dtype="float32")
    processor = get_processor(args, TaskArguments())
    model = force_vision_tokens(load_model(args))
    evaluator = Evaluator(model, processor, "shapes", [], {})
    rows = list(get_dataset(TaskArguments(shapes_train_size=2), "train", max_pixels_of(processor)))  # images drawn
    generated = evaluator.generate(rows, [row["image"] for row in rows], max_new_tokens=8)
    vision_ids = set(vision_special_token_ids(processor.tokenizer))
    assert len(generated) == 2 and all(g["ids"] for g in generated)
    assert not any(vision_ids & set(g["ids"]) for g in generated)
