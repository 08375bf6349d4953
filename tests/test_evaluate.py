"""`eval/evaluate.py` end to end on the tiny model: an adapter from a real two-step training run evaluated on
held-out shapes, out-of-distribution shapes and the GeoQA fixture; every field of the result file and the summary
recomputed from the records; refused adapters; batch-size invariance; resuming after a real SIGKILL.

Two models are used. The embedded tiny model (random weights) answers every prompt with the same newlines, so
tests whose point is that outputs do not change (batch size, resume) use a copy whose language weights are redrawn
larger (`varied_model`): its greedy outputs differ from prompt to prompt, so a swapped or changed answer shows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, run_script
from peft import LoraConfig, get_peft_model
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.geoqa_fixture import write_fixture
from vision_grpo.data.prompts_and_images import fill_image
from vision_grpo.evaluation import evaluate, pass_at_k, results
from vision_grpo.evaluation.adapters import (
    MERGED_ADAPTER,
    MERGED_ADAPTER_WEIGHTS,
    AdapterMismatch,
    adapter_digest,
    load_verified_adapter,
)
from vision_grpo.evaluation.eval_options import EvalArguments
from vision_grpo.evaluation.evaluate import TIMING_KEYS
from vision_grpo.evaluation.evaluator import Evaluator, default_max_new_tokens
from vision_grpo.evaluation.results import partial_path, reproducible_argv
from vision_grpo.evaluation.scoring import summarize
from vision_grpo.models.embedded import TINY_MODEL
from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
from vision_grpo.models.replicas.build import build_tokenizer
from vision_grpo.models.replicas.families import FAMILIES, qwen2_5_vl_config
from vision_grpo.models.vision import is_vision_parameter
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.training.holdout import HoldoutAccuracy

RECIPE_CLASSES = (TaskArguments, GRPOConfig, ModelConfig, EvalArguments)
SHAPES_RECIPE = "recipes/shapes/tiny_cpu.yaml"
GEOQA_RECIPE = "recipes/geoqa/tiny_cpu.yaml"
SHAPING_PLUGIN = '''
from vision_grpo.rewards import completion_texts, reward


@reward()
def eval_length_shaping(completions, **kwargs):
    """Test only: longer completions score more, so rewards vary within a group and the LoRA weights move."""
    return [len(text) / 10 for text in completion_texts(completions)]
'''
RECORD_KEYS = {"id", "gold", "prediction", "correct", "completion_tokens", "hit_limit", "text", "rewards"}
SUMMARY_KEYS = {
    "n",
    "accuracy",
    "format_rate",
    "conditional_accuracy",
    "unparsed",
    "unparsed_hit_limit",
    "mean_completion_tokens",
    "mean_completion_tokens_formatted",
    "samples_per_s",
    "total_seconds",
    "rewards",
}
METADATA_KEYS = {"model", "adapter", "recipe", "dataset", "dataset_revision", "packages", "max_new_tokens", "seed"}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run of two GRPO steps through the real entry point: the final folder, with `checkpoint-2` inside."""
    root = tmp_path_factory.mktemp("trained")
    (root / "plugins").mkdir()
    (root / "plugins" / "shaping.py").write_text(SHAPING_PLUGIN)
    overrides = {
        "--output_dir": str(root / "runs"),
        "--run_name": "lora",
        "--max_steps": "2",
        "--save_steps": "2",
        "--shapes_train_size": "8",
        "--per_device_train_batch_size": "4",
        "--num_generations": "4",
        "--max_completion_length": "8",
        "--token_check_samples": "4",
        "--report_to": "none",
        "--reward_dirs": str(root / "plugins"),
    }
    rewards = ["--reward_funcs", "count_correct", "eval_length_shaping", "--reward_weights", "1", "1"]
    run_script(["recipes/train.py", "--config", SHAPES_RECIPE, *(x for kv in overrides.items() for x in kv), *rewards])
    return root / "runs" / "lora"


@pytest.fixture(scope="module")
def varied_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its language weights redrawn (std 0.1, fixed seed): input-dependent greedy outputs."""
    path = tmp_path_factory.mktemp("varied") / "model"
    shutil.copytree(tiny_model_path, path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and not is_vision_parameter(name):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def geoqa_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("geoqa") / "geoqa.parquet", train_rows=8)


def load_tiny() -> torch.nn.Module:
    return load_model(ModelConfig(model_name_or_path=TINY_MODEL, dtype="float32"))


def evaluate_to(output: Path, *args: str) -> dict:
    """Run the evaluator in this process (as the command line does) and return the file it wrote."""
    evaluate.main([*args, "--output", str(output)])
    assert not partial_path(output).exists(), "the partial file outlived a finished run"
    return json.loads(output.read_text(encoding="utf-8"))


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def check_summary_from_records(result: dict) -> None:
    """Every summary number, counted again from the records by hand."""
    records, summary = result["records"], result["summary"]
    assert summary.keys() >= SUMMARY_KEYS and all(r.keys() >= RECORD_KEYS for r in records)
    assert len({r["id"] for r in records}) == len(records) == summary["n"]
    formatted = [r for r in records if r["prediction"] is not None]
    for r in records:
        assert r["correct"] == (r["prediction"] == r["gold"])
        assert r["completion_tokens"] <= result["metadata"]["max_new_tokens"]
        assert not r["hit_limit"] or r["completion_tokens"] == result["metadata"]["max_new_tokens"]
    assert summary["accuracy"] == sum(r["correct"] for r in records) / len(records)
    assert summary["format_rate"] == len(formatted) / len(records)
    assert summary["conditional_accuracy"] == mean([float(r["correct"]) for r in formatted])
    assert summary["unparsed"] == len(records) - len(formatted)
    assert summary["unparsed_hit_limit"] == sum(r["hit_limit"] for r in records if r["prediction"] is None)
    assert summary["mean_completion_tokens"] == mean([r["completion_tokens"] for r in records])
    assert summary["mean_completion_tokens_formatted"] == mean([r["completion_tokens"] for r in formatted])
    for name, value in summary["rewards"].items():  # a reward part may abstain (None) on an example
        assert value == pytest.approx(mean([r["rewards"][name] for r in records if r["rewards"][name] is not None]))
    assert summary["total_seconds"] > 0 and summary["samples_per_s"] == pytest.approx(
        len(records) / summary["total_seconds"]
    )
    # And the library function agrees with the file on everything but time.
    recomputed = summarize(records)
    assert {k: v for k, v in summary.items() if k not in TIMING_KEYS} == recomputed


def test_summary_counts_on_chosen_records() -> None:
    def record(i: int, prediction: str | None, gold: str, tokens: int, hit: bool) -> dict:
        return {"id": str(i), "gold": gold, "prediction": prediction, "correct": prediction == gold,
                "completion_tokens": tokens, "hit_limit": hit, "text": f"t{i}", "rewards": {"r": float(i)}}  # fmt: skip

    records = [record(0, "A", "A", 10, False), record(1, "B", "A", 20, False), record(2, None, "C", 64, True)]
    records.append(record(3, None, "D", 30, False))
    summary = summarize(records)
    assert (summary["n"], summary["accuracy"], summary["format_rate"]) == (4, 0.25, 0.5)
    assert (summary["conditional_accuracy"], summary["unparsed"], summary["unparsed_hit_limit"]) == (0.5, 2, 1)
    assert (summary["mean_completion_tokens"], summary["mean_completion_tokens_formatted"]) == (31.0, 15.0)
    assert summary["rewards"] == {"r": 1.5}


@pytest.mark.slow
def test_adapter_on_held_out_shapes_and_blank_control(trained_run: Path, tmp_path: Path) -> None:
    args = ["--config", SHAPES_RECIPE, "--adapter", str(trained_run / "checkpoint-2"), "--limit", "12"]
    result = evaluate_to(tmp_path / "shapes.json", *args, "--batch_size", "4")
    check_summary_from_records(result)
    metadata = result["metadata"]
    assert metadata.keys() >= METADATA_KEYS and metadata["recipe"] == SHAPES_RECIPE
    assert metadata["adapter"].endswith("checkpoint-2") and metadata["adapter_base"]
    assert metadata["max_new_tokens"] == 24  # the recipe's max_completion_length
    assert metadata["dataset"]["eval"]["seed"] == 2 and metadata["packages"]["transformers"]
    summary = result["summary"]
    assert set(summary["rewards"]) == {"count_correct", "count_description", "count_reasoning", "count_format"}
    shapes = {r["shape"] for r in result["records"]}
    counts = {r["gold"] for r in result["records"]}
    assert set(summary["accuracy_by_shape"]) == shapes and set(summary["accuracy_by_count"]) == counts
    for shape, accuracy in summary["accuracy_by_shape"].items():
        assert accuracy == mean([float(r["correct"]) for r in result["records"] if r["shape"] == shape])

    blank = evaluate_to(tmp_path / "blank.json", *args, "--batch_size", "4", "--image_control", "blank")
    assert [r["id"] for r in blank["records"]] == [r["id"] for r in result["records"]]
    assert blank["metadata"]["image_control"] == "blank"
    check_summary_from_records(blank)


@pytest.mark.slow
def test_out_of_distribution_counts(varied_model: Path, tmp_path: Path) -> None:
    ood = ["--shapes_min_count", "6", "--shapes_max_count", "7", "--shapes_canvas", "256"]
    args = ["--config", SHAPES_RECIPE, "--model_name_or_path", str(varied_model), *ood, "--limit", "8"]
    result = evaluate_to(tmp_path / "ood.json", *args, "--max_new_tokens", "8")
    assert {r["gold"] for r in result["records"]} <= {"6", "7"}
    assert set(result["summary"]["accuracy_by_count"]) <= {"6", "7"}
    generator = result["metadata"]["dataset"]["generator"]
    assert (generator["min_count"], generator["max_count"], generator["canvas"]) == (6, 7, 256)
    check_summary_from_records(result)


@pytest.mark.slow
def test_final_adapter_folder_on_the_geoqa_fixture(trained_run: Path, geoqa_fixture: Path, tmp_path: Path) -> None:
    args = ["--config", GEOQA_RECIPE, "--dataset_name", str(geoqa_fixture), "--adapter", str(trained_run)]
    result = evaluate_to(tmp_path / "geoqa.json", *args, "--limit", "6", "--max_new_tokens", "8", "--merge_adapter")
    check_summary_from_records(result)
    assert {r["gold"] for r in result["records"]} <= set("ABCD")
    assert result["metadata"]["dataset"]["name"] == str(geoqa_fixture) and result["metadata"]["merged"]
    assert "dataset_revision" in result["metadata"]
    assert set(result["summary"]["rewards"]) == {"boxed_option", "boxed_option_format"}


@pytest.mark.parametrize("recipe", ["recipes/geoqa/qwen3_5_4b_lora.yaml", "recipes/geoqa/qwen2_5_vl_3b_lora.yaml"])
def test_geoqa_default_token_limit_is_the_seeds(recipe: str) -> None:
    task, train, _, _ = parse_recipe(RECIPE_CLASSES, ["--config", recipe, "--bf16", "false"])  # no GPU here
    assert default_max_new_tokens(task, train) == 1024


def test_the_holdout_curve_and_the_evaluator_generate_the_same_number_of_tokens(geoqa_fixture: Path) -> None:
    task, train, model_args, _ = parse_recipe(
        RECIPE_CLASSES, ["--config", GEOQA_RECIPE, "--dataset_name", str(geoqa_fixture), "--holdout_eval_steps", "1"]
    )
    trainer = SimpleNamespace(processing_class=get_processor(model_args, task), args=train)
    holdout = HoldoutAccuracy.from_recipe(trainer, task, [])
    assert holdout.max_new_tokens == default_max_new_tokens(task, train) == train.max_completion_length


@pytest.mark.slow
def test_checkpoint_and_final_folders_attach_and_merge(trained_run: Path) -> None:
    base = load_tiny()
    processor = get_processor(ModelConfig(model_name_or_path=TINY_MODEL), TaskArguments())
    image = Image.new("RGB", (140, 140), "white")
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles?"}]}]
    inputs = Evaluator(base, processor, "shapes", [], {}).encode([{"prompt": prompt}], [image])

    def logits(model: torch.nn.Module) -> torch.Tensor:
        with torch.inference_mode():
            return model(**inputs).logits

    base_logits = logits(base)
    checkpoint = logits(load_verified_adapter(load_tiny(), trained_run / "checkpoint-2"))
    final = logits(load_verified_adapter(load_tiny(), trained_run))
    merged = logits(load_verified_adapter(load_tiny(), trained_run, merge=True))
    assert not torch.allclose(checkpoint, base_logits, atol=1e-4), "the adapter did not change the model"
    assert torch.equal(checkpoint, final)  # the run ended at step 2: the same weights
    torch.testing.assert_close(merged, checkpoint, atol=1e-5, rtol=1e-4)


def _tampered(trained_run: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "renamed"
    folder.mkdir()
    shutil.copy(trained_run / "adapter_config.json", folder)
    weights = load_file(str(trained_run / "adapter_model.safetensors"))
    renamed = {key.replace("layers.1.", "blocks.1."): value for key, value in weights.items()}
    save_file(renamed, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.slow
def test_renamed_adapter_keys_are_refused_by_name(trained_run: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterMismatch, match=r"14 of 28 adapter weights .* did not attach.*blocks\.1\."):
        load_verified_adapter(load_tiny(), _tampered(trained_run, tmp_path))


def test_adapter_of_a_base_with_other_dimensions_is_refused(tmp_path: Path) -> None:
    config = qwen2_5_vl_config(build_tokenizer(FAMILIES["qwen2.5-vl"]))
    config.text_config.hidden_size = config.vision_config.out_hidden_size = 64
    other = get_peft_model(Qwen2_5_VLForConditionalGeneration(config), LoraConfig(r=4, target_modules=["q_proj"]))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(AdapterMismatch, match=r"does not fit the base model .*size mismatch"):
        load_verified_adapter(load_tiny(), tmp_path / "other")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("keep", "message"),
    [
        (["adapter_config.json"], "has no adapter_model.safetensors"),
        (["adapter_model.safetensors", "trainer_state.json"], "has no adapter_config.json"),
        ([], "has no adapter_config.json and no adapter_model.safetensors"),
    ],
    ids=["no-weights", "checkpoint-without-config", "empty"],
)
def test_incomplete_adapter_folders_are_refused_before_loading(
    trained_run: Path, tmp_path: Path, keep: list[str], message: str
) -> None:
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    for name in keep:
        shutil.copy(trained_run / "checkpoint-2" / name, folder)
    with pytest.raises(AdapterMismatch, match=message):
        evaluate.main(["--config", SHAPES_RECIPE, "--adapter", str(folder), "--output", str(tmp_path / "x.json")])


def test_full_model_folder_as_adapter_points_to_model_name_or_path(tiny_model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterMismatch, match="--model_name_or_path"):
        evaluate.main(["--config", SHAPES_RECIPE, "--adapter", str(tiny_model_path), "--output", str(tmp_path / "x")])


def _holding_the_adapter(adapter: Path, model: Path) -> str:
    """`model`: a folder holding the adapter's own files (transformers loads them with the model)."""
    shutil.copytree(adapter, model)
    return "holds the adapter of --adapter .*adapter itself .*pass its base \\(vision-grpo/tiny-qwen2.5-vl\\)"


def _export_of_the_adapter(adapter: Path, model: Path) -> str:
    """`model`: an export whose model card records the adapter merged into it (as vision_grpo.export writes it)."""
    model.mkdir()
    card = f"---\n{MERGED_ADAPTER}: runs/x\n{MERGED_ADAPTER_WEIGHTS}: {adapter_digest(adapter)}\n---\n# x\n"
    (model / "README.md").write_text(card)
    return "is an export with --adapter .*adapter already merged into it \\(its README.md records merged_adapter runs/x"


@pytest.mark.parametrize("entry", [evaluate.main, pass_at_k.main], ids=["evaluate", "pass_at_k"])
@pytest.mark.parametrize("model_of", [_holding_the_adapter, _export_of_the_adapter], ids=["adapter-folder", "export"])
def test_an_adapter_the_model_already_holds_is_refused_naming_both(tmp_path: Path, entry, model_of) -> None:
    """Applied to weights that hold it already, an adapter counts twice: the result would be of weights nobody
    trained, filed under the adapter's name. Refused before anything loads, by content (another path, same files)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": TINY_MODEL}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    message = model_of(adapter, tmp_path / "model")
    argv = ["--config", SHAPES_RECIPE, "--model_name_or_path", str(tmp_path / "model"), "--adapter", str(adapter)]
    with pytest.raises(AdapterMismatch, match=rf"^--model_name_or_path .*model {message}"):
        entry([*argv, "--output", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()


def test_rows_skipped_under_skip_bad_rows_are_recorded_in_the_result(tmp_path: Path) -> None:
    """An evaluation that skipped a row scores fewer rows than the split holds: before, only the log said so, and
    the result file read as an evaluation of the whole split."""
    folder = tmp_path / "vqa"
    (folder / "images").mkdir(parents=True)
    Image.new("RGB", (40, 40), "white").save(folder / "images" / "ok.png")
    rows = [{"id": "good", "image": "ok.png"}, {"id": "no-image", "image": "missing.png"}, {"id": "also-good"}]
    lines = [{"image": "ok.png", "question": "How many?", "answer": "3", **row} for row in rows]
    (folder / "test.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = ["--dataset_name", str(folder), "--vqa_image_folder", str(folder / "images")]
    data += ["--vqa_image_column", "image", "--skip_bad_rows", "true"]
    result = evaluate_to(
        tmp_path / "r.json", "--config", "recipes/vqa/tiny_clevr_count.yaml", *data, "--max_new_tokens", "2"
    )
    assert [record["id"] for record in result["records"]] == ["good", "also-good"]
    assert result["metadata"]["rows_unused"] == {"invalid, skipped (skip_bad_rows)": 1}
    assert result["metadata"]["rows_unused_ids"] == {"invalid, skipped (skip_bad_rows)": ["no-image"]}


@pytest.mark.parametrize("entry", [evaluate.main, pass_at_k.main], ids=["evaluate", "pass_at_k"])
@pytest.mark.parametrize("recipe", [SHAPES_RECIPE, "recipes/shapes/tiny_sft.yaml"], ids=["grpo", "sft"])
def test_output_in_a_missing_folder_fails_at_once(tmp_path: Path, entry, recipe: str) -> None:
    # An SFT recipe parses too (its SFT-only keys, such as `max_length`, are checked and left out): the failure is the
    # output folder, the first check after the recipe
    with pytest.raises(FileNotFoundError, match="output folder .*missing does not exist"):
        entry(["--config", recipe, "--output", str(tmp_path / "missing" / "eval.json")])


def test_an_sft_recipe_key_of_the_wrong_type_is_still_refused(tmp_path: Path) -> None:
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(
        (REPO / "recipes/shapes/tiny_sft.yaml").read_text().replace("max_length: null", "max_length: [1]")
    )
    with pytest.raises(RecipeError, match=r"`max_length: \[1\]` has type list"):
        evaluate.main(["--config", str(recipe), "--output", str(tmp_path / "eval.json")])


def _header_and_records(records: int) -> bytes:
    """A partial file's bytes: a settings header, then `records` records whose text is not ASCII."""
    lines = [{"metadata": {"model": "m"}}, *({"id": f"r{i}", "text": "é∑ 数"} for i in range(records))]
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()


def test_a_finished_result_is_not_replaced_without_overwrite(tmp_path: Path) -> None:
    output = tmp_path / "eval.json"
    output.write_text('{"summary": {}, "records": []}')
    with pytest.raises(results.OutputConflict, match=r"eval.json already holds a result: pass --overwrite"):
        evaluate.main(["--config", SHAPES_RECIPE, "--output", str(output)])
    assert output.read_text() == '{"summary": {}, "records": []}'


def test_an_interrupted_evaluation_is_not_thrown_away_without_resume(tmp_path: Path) -> None:
    output = tmp_path / "eval.json"
    partial_path(output).write_bytes(_header_and_records(2))
    before = partial_path(output).read_bytes()
    with pytest.raises(results.OutputConflict, match=r"holds 2 record\(s\) .*--resume .*--overwrite"):
        evaluate.main(["--config", SHAPES_RECIPE, "--output", str(output)])
    assert partial_path(output).read_bytes() == before and not output.exists()


def test_a_partial_file_cut_inside_a_character_resumes_from_its_complete_lines(tmp_path: Path) -> None:
    partial = tmp_path / "eval.json.partial.jsonl"
    whole = _header_and_records(3)
    partial.write_bytes(whole[: whole.rindex("数".encode()) + 1])  # the last record cut inside a 3-byte character
    assert set(results.read_partial(partial, {"model": "m"})) == {"r0", "r1"}


def _hold(output: str, held, release) -> None:
    """A process holding the output as a running evaluation does, until told to let go."""
    with results.hold_output(Path(output)):
        held.set()
        release.wait(60)


def test_a_second_evaluation_of_one_output_fails_at_once_naming_the_first(tmp_path: Path) -> None:
    """Two real processes: one holds the output (as a running evaluation does); the second evaluation stops before
    loading anything and writes nothing; the lock file goes with its holder. The holder is a fork of this process,
    which has imported the evaluator already (a fresh interpreter spends seconds importing it)."""
    output = tmp_path / "eval.json"
    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(str(output), held, release))
    holder.start()
    try:
        assert held.wait(60), "the holder never took the lock"
        second = run_script(["eval/evaluate.py", "--config", SHAPES_RECIPE, "--output", str(output)], check=False)
    finally:
        release.set()
        holder.join(60)
    assert second.returncode == 1
    assert f"another evaluation (pid {holder.pid}) is writing {output}" in second.stderr.strip().splitlines()[-1]
    assert holder.exitcode == 0 and list(tmp_path.iterdir()) == [], "the lock file or a partial file was left"


@pytest.mark.slow
def test_resuming_after_the_adapter_changed_is_refused_before_the_model_loads(
    trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter, output = tmp_path / "adapter", tmp_path / "eval.json"
    shutil.copytree(trained_run / "checkpoint-2", adapter)
    args = ["--config", SHAPES_RECIPE, "--adapter", str(adapter), "--limit", "4", "--batch_size", "2"]
    args += ["--max_new_tokens", "4", "--output", str(output)]
    original, calls = Evaluator.generate, []

    def interrupted(self: Evaluator, rows: list[dict], images: list, max_new_tokens: int) -> list[dict]:
        calls.append(len(rows))
        if len(calls) == 2:
            raise KeyboardInterrupt  # as Ctrl-C after the first batch
        return original(self, rows, images, max_new_tokens)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(Evaluator, "generate", interrupted)
        evaluate.main(args)
    assert len(_records_in(partial_path(output))) == 2
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({name: tensor * 2 for name, tensor in weights.items()}, str(adapter / "adapter_model.safetensors"))
    before = partial_path(output).read_bytes()

    def not_loaded(*args, **kwargs) -> None:
        raise AssertionError("the model was loaded before the resume was refused")

    monkeypatch.setattr(evaluate, "build_evaluator", not_loaded)
    with pytest.raises(results.OutputConflict, match=r"cannot resume: .* \(adapter_weights: '[0-9a-f]{64}' then"):
        evaluate.main([*args, "--resume"])
    assert partial_path(output).read_bytes() == before


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_batches_are_left_padded_without_processor_warnings(geoqa_fixture: Path) -> None:
    task, _, model_args, _ = parse_recipe(
        RECIPE_CLASSES, ["--config", GEOQA_RECIPE, "--dataset_name", str(geoqa_fixture)]
    )
    processor = get_processor(model_args, task)
    rows = list(get_dataset(task, "eval", max_pixels_of(processor)).select(range(8)))
    evaluator = Evaluator(load_tiny(), processor, "geoqa", [], {})
    handler = _Collect()
    logging.getLogger("transformers").addHandler(handler)  # transformers' loggers do not propagate to the root
    try:
        inputs = evaluator.encode(rows, [row["image"] for row in rows])
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in handler.messages if "processor_kwargs" in m], handler.messages
    mask = inputs["attention_mask"]
    lengths = mask.sum(dim=1)
    assert lengths.min() < lengths.max(), "prompts of equal length: padding was not exercised"
    assert bool(mask[:, -1].all()), "padding on the right: generation would continue after pad tokens"
    for row_mask, length in zip(mask, lengths, strict=True):  # ones form one block at the end
        assert bool(row_mask[-int(length) :].all()) and not bool(row_mask[: -int(length)].any())


def test_generation_inputs_are_those_training_gives_the_model(geoqa_fixture: Path) -> None:
    """TRL passes every processor field to `generate` in training; the evaluator must too. Qwen-VL places its
    multimodal rotary positions with `mm_token_type_ids`: dropping it made a trained model answer differently."""
    task, _, model_args, _ = parse_recipe(
        RECIPE_CLASSES, ["--config", GEOQA_RECIPE, "--dataset_name", str(geoqa_fixture)]
    )
    processor = get_processor(model_args, task)
    rows = list(get_dataset(task, "eval", max_pixels_of(processor)).select(range(2)))
    evaluator = Evaluator(load_tiny(), processor, "geoqa", [], {})
    inputs = evaluator.encode(rows, [row["image"] for row in rows])
    rendered = processor.apply_chat_template(
        [fill_image(row["prompt"], row["image"]) for row in rows],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"padding": True},
    )
    assert "mm_token_type_ids" in rendered
    assert set(inputs) == set(rendered)


@pytest.mark.slow
def test_batch_size_one_and_eight_give_identical_records(
    varied_model: Path, geoqa_fixture: Path, tmp_path: Path
) -> None:
    args = ["--config", GEOQA_RECIPE, "--dataset_name", str(geoqa_fixture), "--model_name_or_path", str(varied_model)]
    args += ["--limit", "16", "--max_new_tokens", "12"]
    one = evaluate_to(tmp_path / "b1.json", *args, "--batch_size", "1")
    eight = evaluate_to(tmp_path / "b8.json", *args, "--batch_size", "8")
    assert len({r["text"] for r in one["records"]}) >= 8, "outputs barely depend on the input: a weak comparison"
    assert one["records"] == eight["records"]


def test_reproducible_argv_drops_only_resume() -> None:
    argv = ["--config", "r.yaml", "--resume", "--limit", "4", "--resume", "true", "--resume=false", "--merge_adapter"]
    assert reproducible_argv(argv) == ["--config", "r.yaml", "--limit", "4", "--merge_adapter"]


def _records_in(partial: Path) -> list[dict]:
    records = []
    for line in partial.read_text(encoding="utf-8").splitlines()[1:]:  # the first line is the settings header
        with contextlib.suppress(json.JSONDecodeError):  # the line the kill cut
            records.append(json.loads(line))
    return records


@pytest.mark.slow
def test_resume_after_sigkill_gives_the_uninterrupted_file(
    varied_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = tmp_path / "eval.json"
    args = ["--config", SHAPES_RECIPE, "--model_name_or_path", str(varied_model), "--limit", "16"]
    args += ["--batch_size", "1", "--max_new_tokens", "32", "--output", str(output)]
    evaluate.main(args)
    uninterrupted = json.loads(output.read_text(encoding="utf-8"))
    output.unlink()

    log = tmp_path / "killed.log"
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "eval/evaluate.py", *args], cwd=REPO, stdout=sink, stderr=sink)
    partial, deadline = partial_path(output), time.monotonic() + 300
    while not (partial.exists() and len(_records_in(partial)) >= 3):
        assert process.poll() is None, f"the evaluator ended before it could be killed:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no records after 300 s"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not output.exists()
    done = {r["id"] for r in _records_in(partial)}
    assert 3 <= len(done) < 16

    with pytest.raises(ValueError, match="cannot resume.*max_new_tokens"):
        evaluate.main([*args, "--resume", "--max_new_tokens", "30"])
    generated: list[str] = []
    original = Evaluator.generate

    def counting(self: Evaluator, rows: list[dict], images: list, max_new_tokens: int) -> list[dict]:
        generated.extend(row["id"] for row in rows)
        return original(self, rows, images, max_new_tokens)

    monkeypatch.setattr(Evaluator, "generate", counting)
    evaluate.main([*args, "--resume"])
    assert len(generated) == 16 - len(done) and not done & set(generated), "finished examples were redone"
    resumed = json.loads(output.read_text(encoding="utf-8"))
    assert not partial_path(output).exists()
    for result in (resumed, uninterrupted):
        for key in TIMING_KEYS:
            result["summary"].pop(key)
    assert resumed == uninterrupted


@pytest.fixture(scope="module")
def penalised_model(varied_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`varied_model` whose checkpoint generation config asks for what Qwen2.5-VL's ships and more: a repetition
    penalty, top-k/top-p, a no-repeat rule and a minimum length."""
    path = tmp_path_factory.mktemp("penalised") / "model"
    shutil.copytree(varied_model, path)
    config = GenerationConfig.from_pretrained(path)
    config.update(repetition_penalty=5.0, top_k=1, top_p=0.001, no_repeat_ngram_size=1, min_new_tokens=6)
    config.save_pretrained(path)
    return path


@pytest.mark.slow
def test_the_checkpoints_generation_config_has_no_effect(varied_model: Path, penalised_model: Path) -> None:
    processor = get_processor(ModelConfig(model_name_or_path=TINY_MODEL), TaskArguments())
    rows = list(get_dataset(TaskArguments(shapes_eval_size=6), "eval", max_pixels_of(processor)))
    images = [row["image"] for row in rows]

    def texts(path: Path) -> list[str]:
        model = load_model(ModelConfig(model_name_or_path=str(path), dtype="float32"))
        assert (model.generation_config.repetition_penalty == 5.0) is (path == penalised_model)
        return [g["text"] for g in Evaluator(model, processor, "shapes", [], {}).generate(rows, images, 12)]

    assert texts(penalised_model) == texts(varied_model)
    # Without our generation config the checkpoint's settings do change the answers: the comparison can fail.
    model = load_model(ModelConfig(model_name_or_path=str(penalised_model), dtype="float32"))
    inputs = Evaluator(model, processor, "shapes", [], {}).encode(rows, images)
    with torch.inference_mode():
        leaked = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    leaked_texts = processor.tokenizer.batch_decode(leaked[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert leaked_texts != texts(varied_model)
    assert model.generation_config.repetition_penalty == 5.0, "generation swapped the model's config for good"


def test_the_generation_config_is_greedy_explicit_and_suppresses_vision_tokens() -> None:
    processor = get_processor(ModelConfig(model_name_or_path=TINY_MODEL), TaskArguments())
    model = load_tiny()
    evaluator = Evaluator(model, processor, "shapes", [], {})
    decoding = evaluator.decoding(24)
    tokenizer = processor.tokenizer
    assert decoding["do_sample"] is False and decoding["max_new_tokens"] == 24
    assert tokenizer.eos_token_id in decoding["eos_token_id"] and decoding["pad_token_id"] == tokenizer.pad_token_id
    vision = {tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")}
    assert vision <= set(decoding["suppress_tokens"])
    assert not {"repetition_penalty", "top_k", "top_p", "temperature"} & set(decoding)


REWARD_READING_COLUMNS = '''
from vision_grpo.rewards import reward


@reward()
def reads_image_and_id(completions, image, id, **kwargs):
    """Test only: a reward that needs the columns training passes (the image and the id)."""
    return [image_.width * 1000.0 + len(id_) for image_, id_ in zip(image, id, strict=True)]
'''


@pytest.mark.slow
def test_rewards_get_the_columns_training_gives_them(tmp_path: Path) -> None:
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "columns.py").write_text(REWARD_READING_COLUMNS)
    rewards = ["--reward_funcs", "count_correct", "reads_image_and_id", "--reward_weights", "1", "0"]
    args = ["--config", SHAPES_RECIPE, "--reward_dirs", str(tmp_path / "plugins"), *rewards, "--limit", "4"]
    result = evaluate_to(tmp_path / "eval.json", *args, "--max_new_tokens", "2")
    task, _, model_args, _ = parse_recipe(RECIPE_CLASSES, ["--config", SHAPES_RECIPE])
    dataset = get_dataset(task, "eval", max_pixels_of(get_processor(model_args, task)))
    for record, row in zip(result["records"], dataset, strict=False):
        assert record["rewards"]["reads_image_and_id"] == row["image"].width * 1000.0 + len(row["id"])


@pytest.mark.slow
def test_two_processes_give_the_one_process_answers_in_item_order(
    varied_model: Path, geoqa_fixture: Path, tmp_path: Path
) -> None:
    """`torchrun` (as `accelerate launch` starts it) with 2 CPU processes, batches of 3, bucketed by prompt length:
    one result file, in item order, record for record the one-process file in dataset order at batch 8."""
    args = ["--config", GEOQA_RECIPE, "--dataset_name", str(geoqa_fixture), "--model_name_or_path", str(varied_model)]
    args += ["--limit", "16", "--max_new_tokens", "12"]
    one = evaluate_to(tmp_path / "one.json", *args, "--batch_size", "8", "--bucket_by_length", "false")
    two_path = tmp_path / "two.json"
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "eval/evaluate.py"]
    run_script([*launch, *args, "--batch_size", "3", "--output", str(two_path)], env={"ACCELERATE_USE_CPU": "1"})
    two = json.loads(two_path.read_text(encoding="utf-8"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.json", "two.json"], "partial files left behind"
    assert two["metadata"]["num_processes"] == 2 and one["metadata"]["num_processes"] == 1
    assert len({r["text"] for r in one["records"]}) >= 8, "outputs barely depend on the input: a weak comparison"
    assert two["records"] == one["records"]
    assert two["summary"]["n"] == 16


@pytest.mark.parametrize("model", ["vision-grpo/tiny-qwen2.5-vl", "vision-grpo/tiny-qwen3.5"])
def test_the_bucketing_length_is_the_rendered_prompt_length(geoqa_fixture: Path, model: str) -> None:
    task, train, model_args, _ = parse_recipe(
        RECIPE_CLASSES, ["--config", GEOQA_RECIPE, "--dataset_name", str(geoqa_fixture), "--model_name_or_path", model]
    )
    processor = get_processor(model_args, task)
    rows = list(get_dataset(task, "eval", max_pixels_of(processor)).select(range(6)))
    evaluator = Evaluator(load_model(model_args), processor, "geoqa", [], train.chat_template_kwargs or {})
    lengths = [evaluator.prompt_length(row, row["image"]) for row in rows]
    assert lengths == [evaluator.encode([row], [row["image"]])["input_ids"].shape[1] for row in rows]
    assert len(set(lengths)) > 1, "all prompts of one length: the comparison would be weak"


THIRTEEN_BATCHES = ["--config", SHAPES_RECIPE, "--limit", "13", "--batch_size", "1", "--max_new_tokens", "6"]


def launch_evaluation(processes: int, output: Path, *args: str) -> dict:
    """`accelerate launch` with the shipped CPU config (torchrun underneath: really `processes` workers)."""
    launch = ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml"]
    run_script([*launch, "--num_processes", str(processes), "eval/evaluate.py", *args, "--output", str(output)])
    return json.loads(output.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def one_process_thirteen(varied_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    output = tmp_path_factory.mktemp("thirteen") / "one.json"
    return evaluate_to(output, *THIRTEEN_BATCHES, "--model_name_or_path", str(varied_model))


def _without_timing(result: dict) -> dict:
    return {**result, "summary": {k: v for k, v in result["summary"].items() if k not in TIMING_KEYS}}


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 3])
def test_thirteen_batches_on_several_processes_give_the_one_process_records(
    processes: int, varied_model: Path, one_process_thirteen: dict, tmp_path: Path
) -> None:
    """13 batches do not divide over 2 or 3 processes: in the last round some ranks have no batch, and must still
    take part in the gather and add nothing."""
    many = launch_evaluation(
        processes, tmp_path / "many.json", *THIRTEEN_BATCHES, "--model_name_or_path", str(varied_model)
    )
    assert many["metadata"]["num_processes"] == processes, "the launcher did not start the processes asked for"
    assert len({r["text"] for r in one_process_thirteen["records"]}) >= 5, "outputs barely depend on the input"
    assert many["records"] == one_process_thirteen["records"]
    assert _without_timing(many)["summary"] == _without_timing(one_process_thirteen)["summary"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.json"], "partial or lock files left behind"


@pytest.mark.slow
def test_a_two_process_resume_with_one_batch_left(
    varied_model: Path, one_process_thirteen: dict, tmp_path: Path
) -> None:
    """An interrupted run with 12 of 13 records: one batch is left, so rank 1 has nothing to generate."""
    output = tmp_path / "resumed.json"
    kept = one_process_thirteen["records"][:12]
    lines = [{"metadata": one_process_thirteen["metadata"]}, *kept]
    partial_path(output).write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    args = [*THIRTEEN_BATCHES, "--model_name_or_path", str(varied_model), "--resume"]
    resumed = launch_evaluation(2, output, *args)
    assert resumed["metadata"]["num_processes"] == 2
    assert resumed["records"] == one_process_thirteen["records"]
    assert resumed["summary"]["samples_per_s"] == pytest.approx(1 / resumed["summary"]["total_seconds"])


def test_a_tensor_parallel_size_that_does_not_divide_the_processes_is_refused_naming_the_flag() -> None:
    from vision_grpo.evaluation.vllm_backend import check_tensor_parallel  # imports no vLLM

    with pytest.raises(ValueError, match=r"--tensor_parallel_size 2 must divide the number of processes \(3\)"):
        check_tensor_parallel(2, 3)
    assert [check_tensor_parallel(t, 4) for t in (1, 2, 4)] == [4, 2, 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "vllm", "tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1"),
        ({"tensor_parallel_size": 2}, "--tensor_parallel_size 2 splits a vLLM engine: pass --backend vllm"),
    ],
)
def test_tensor_parallel_size_is_checked_with_the_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvalArguments(**kwargs)


def test_engines_on_one_device_share_vllms_memory_fraction() -> None:
    from vision_grpo.evaluation.vllm_backend import share_of

    assert [share_of(0.9, engines) for engines in (1, 2, 3)] == pytest.approx([0.9, 0.45, 0.3])
