"""`python -m vision_grpo.export`: on every family's replica, a LoRA adapter with random non-zero weights (so that
merging changes the answers) is exported, the folder reloaded with plain transformers and evaluated by the
evaluator: the records must equal the unmerged adapter's. A full fine-tuned run folder (the demo's GRPO output) is
re-saved and answers as before. The refusals, and a model card whose figures are read back against the result
file it names."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import FAMILY_MODELS
from huggingface_hub import ModelCard
from lora_runs import PIXELS, lora_run, randomise, write_run
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from vision_grpo.evaluation import evaluate
from vision_grpo.evaluation.adapters import AdapterMismatch, adapter_digest
from vision_grpo.evaluation.vllm_backend import UnservableAdapter, check_vllm_lora
from vision_grpo.export import export_command as export_cli
from vision_grpo.export.checks import ExportError
from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.models.loading import get_processor, load_model

RECIPE = "recipes/shapes/tiny_cpu.yaml"
EVAL = ["--limit", "6", "--max_new_tokens", "12", "--batch_size", "3"]


def evaluate_records(tmp_path: Path, name: str, *args: str) -> dict:
    output = tmp_path / f"{name}.json"
    return evaluate.main(["--config", RECIPE, "--shapes_eval_size", "6", *EVAL, *args, "--output", str(output)])


def weight_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            names |= set(weights.keys())
    return names


@pytest.mark.slow
@pytest.mark.parametrize("replica", FAMILY_MODELS)
def test_exported_adapter_answers_as_the_unmerged_adapter(replica: str, tmp_path: Path) -> None:
    run_dir = lora_run(tmp_path / "run", replica, RECIPE)
    output = tmp_path / "exported"
    export_cli.main(["--adapter", str(run_dir), "--output", str(output), "--max_shard_size", "200KB"])

    pixels = ["--model_name_or_path", replica, *[f"--{k}={v}" for k, v in PIXELS.items()]]
    adapter = evaluate_records(tmp_path, "adapter", *pixels, "--adapter", str(run_dir))
    base = evaluate_records(tmp_path, "base", *pixels)
    # The exported folder with its own processor: no pixel limits from the command line.
    merged = evaluate_records(tmp_path, "merged", "--model_name_or_path", str(output))
    assert [r["text"] for r in adapter["records"]] != [r["text"] for r in base["records"]], "the LoRA changes nothing"
    assert merged["records"] == adapter["records"]
    assert merged["metadata"]["max_pixels"] == PIXELS["max_pixels"]

    # A standalone checkpoint: sharded safetensors, the base's parameter names (no PEFT ones), the base's
    # generation config byte for byte, loadable by plain transformers.
    assert len(list(output.glob("model-*.safetensors"))) > 1 and (output / "model.safetensors.index.json").is_file()
    base_dir = Path(resolve_model_path(replica))
    assert weight_names(output) == weight_names(base_dir)
    if (base_dir / "generation_config.json").is_file():
        assert (output / "generation_config.json").read_bytes() == (base_dir / "generation_config.json").read_bytes()
    else:  # as Qwen3.5 ships none: none is made up
        assert not (output / "generation_config.json").exists()
    assert json.loads((output / "preprocessor_config.json").read_text())["size"]["longest_edge"] == PIXELS["max_pixels"]
    assert (output / "chat_template.jinja").is_file() and (output / "tokenizer.json").is_file()
    AutoModelForImageTextToText.from_pretrained(output)


@pytest.mark.slow
def test_full_fine_tuned_run_is_resaved_and_answers_as_before(tmp_path: Path) -> None:
    """The demo's GRPO stage fine-tunes the whole model: its run folder holds full weights, not an adapter."""
    replica = FAMILY_MODELS[0]
    run_dir = tmp_path / "run"
    task_args, model_args = write_run(run_dir, replica, RECIPE, use_peft=False)
    model = load_model(model_args)
    randomise(model, "layers.0.mlp", std=0.2)
    model.save_pretrained(run_dir)
    get_processor(model_args, task_args).save_pretrained(run_dir)
    output = tmp_path / "exported"
    export_cli.main(["--adapter", str(run_dir), "--output", str(output)])

    trained = evaluate_records(tmp_path, "trained", "--model_name_or_path", str(run_dir))
    base = evaluate_records(tmp_path, "base", "--model_name_or_path", replica)
    exported = evaluate_records(tmp_path, "exported", "--model_name_or_path", str(output))
    assert [r["text"] for r in trained["records"]] != [r["text"] for r in base["records"]]
    assert exported["records"] == trained["records"]
    assert (output / "preprocessor_config.json").is_file()


@pytest.fixture(scope="module")
def qwen2_5_run(tmp_path_factory) -> Path:
    return lora_run(tmp_path_factory.mktemp("export") / "run", FAMILY_MODELS[0], RECIPE)


def test_output_that_holds_something_is_refused_before_loading(qwen2_5_run: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already holds something"):
        export_cli.main(["--adapter", str(qwen2_5_run), "--output", str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]


def test_adapter_of_other_weights_is_refused(qwen2_5_run: Path, tmp_path: Path) -> None:
    # The same architecture, other weights: the run's manifest names the weights it trained on.
    other = tmp_path / "other-base"
    shutil.copytree(resolve_model_path(FAMILY_MODELS[0]), other)
    model = AutoModelForImageTextToText.from_pretrained(other)
    randomise(model, "layers.0.mlp", std=0.1)
    model.save_pretrained(other)
    argv = ["--adapter", str(qwen2_5_run), "--output", str(tmp_path / "out"), "--model_name_or_path", str(other)]
    with pytest.raises(ExportError, match="trained on other weights"):
        export_cli.main(argv)
    assert not (tmp_path / "out").exists()


def test_absent_base_is_refused(qwen2_5_run: Path, tmp_path: Path) -> None:
    argv = ["--adapter", str(qwen2_5_run), "--output", str(tmp_path / "out")]
    with pytest.raises(ExportError, match="is not available here"):
        export_cli.main([*argv, "--model_name_or_path", str(tmp_path / "gone")])


def test_push_to_hub_is_refused_offline_before_any_work(qwen2_5_run: Path, tmp_path: Path) -> None:
    argv = ["--adapter", str(qwen2_5_run), "--output", str(tmp_path / "out"), "--push_to_hub", "me/policy"]
    with pytest.raises(ExportError, match="HF_HUB_OFFLINE=1"):
        export_cli.main(argv)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_model_card_figures_are_the_result_files(qwen2_5_run: Path, tmp_path: Path) -> None:
    result_path = tmp_path / "adapter.json"
    pixels = [f"--{k}={v}" for k, v in PIXELS.items()]
    evaluate.main(["--config", RECIPE, *EVAL, *pixels, "--adapter", str(qwen2_5_run), "--output", str(result_path)])
    output = tmp_path / "exported"
    export_cli.main(["--adapter", str(qwen2_5_run), "--output", str(output), "--eval", str(result_path)])

    result = json.loads(result_path.read_text())
    card = ModelCard.load(output / "README.md")
    data = card.data.to_dict()
    assert data["eval"]["n"] == result["summary"]["n"] == len(result["records"])
    assert data["eval"]["accuracy"] == result["summary"]["accuracy"]
    assert data["eval"]["format_rate"] == result["summary"]["format_rate"]
    assert data["eval"]["decoding"] == result["metadata"]["generation_config"]
    assert data["eval"]["file"] == str(result_path)
    recipe = (qwen2_5_run / "recipe.yaml").read_bytes()
    assert data["recipe_sha256"] == hashlib.sha256(b"recipe.yaml\0" + recipe).hexdigest()
    assert data["base_model"] == FAMILY_MODELS[0]
    assert data["training_steps"] == json.loads((qwen2_5_run / "manifest.json").read_text())["global_step"]
    trained = yaml.safe_load(recipe)
    assert data["rewards"] == dict(zip(trained["reward_funcs"], trained["reward_weights"], strict=True))
    assert f"| {result['summary']['n']} | {result['summary']['accuracy']} |" in card.text


def test_the_card_records_the_merged_adapter_and_the_evaluator_refuses_it_on_the_export(
    qwen2_5_run: Path, tmp_path: Path
) -> None:
    """The export holds the adapter's change already: evaluating it with `--adapter <the run>` again would add it
    twice and file the result under the adapter. The card records which adapter (by path and content); the
    evaluator reads it and refuses, naming both, before the model loads."""
    output = tmp_path / "exported"
    export_cli.main(["--adapter", str(qwen2_5_run), "--output", str(output)])
    data = ModelCard.load(output / "README.md").data.to_dict()
    assert data["merged_adapter"] == str(qwen2_5_run)
    assert data["merged_adapter_weights"] == adapter_digest(qwen2_5_run)
    copy = shutil.copytree(qwen2_5_run, tmp_path / "copy-of-the-run")  # the same adapter under another path
    for adapter in (qwen2_5_run, copy):
        with pytest.raises(AdapterMismatch, match=rf"{output} is an export with --adapter {adapter} already merged"):
            evaluate_records(tmp_path, "twice", "--model_name_or_path", str(output), "--adapter", str(adapter))
    assert not (tmp_path / "twice.json").exists()


def test_eval_file_of_other_weights_is_refused(qwen2_5_run: Path, tmp_path: Path) -> None:
    result = tmp_path / "other.json"
    result.write_text(json.dumps({"summary": {}, "records": [], "metadata": {"adapter_weights": "f" * 64}}))
    argv = ["--adapter", str(qwen2_5_run), "--output", str(tmp_path / "out"), "--eval", str(result)]
    with pytest.raises(ExportError, match="evaluated other weights"):
        export_cli.main(argv)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_vision_tower_lora_is_merged_by_export_and_refused_by_vllm_unmerged(tmp_path: Path) -> None:
    run_dir = lora_run(tmp_path / "run", FAMILY_MODELS[0], RECIPE, lora_on_vision=True)
    with pytest.raises(UnservableAdapter, match="vision tower.*python -m vision_grpo.export"):
        check_vllm_lora(run_dir)
    output = tmp_path / "exported"
    export_cli.main(["--adapter", str(run_dir), "--output", str(output)])
    pixels = [f"--{k}={v}" for k, v in PIXELS.items()]
    adapter = evaluate_records(tmp_path, "adapter", *pixels, "--adapter", str(run_dir))
    merged = evaluate_records(tmp_path, "merged", "--model_name_or_path", str(output))
    assert merged["records"] == adapter["records"]
    assert ModelCard.load(output / "README.md").data.to_dict()["vision_tower_lora_merged"] is True


def test_language_model_lora_is_served_by_vllm_unmerged(qwen2_5_run: Path) -> None:
    rank = json.loads((qwen2_5_run / "adapter_config.json").read_text())["r"]
    assert check_vllm_lora(qwen2_5_run) >= rank


def test_an_sft_run_is_exported_with_its_own_trainer_config_and_card(tmp_path: Path) -> None:
    """recipes/sft.py's run folder: its recipe holds SFTConfig keys GRPOConfig refuses (`max_length`); the export
    reads them with the trainer's config the manifest names, and the card tells an SFT run (no rewards, its command)."""
    run_dir = lora_run(tmp_path / "run", FAMILY_MODELS[0], RECIPE)
    recipe = {**yaml.safe_load((run_dir / "recipe.yaml").read_text()), "max_length": None}
    for grpo_only in ("num_generations", "max_completion_length", "temperature", "beta", "reward_weights"):
        recipe.pop(grpo_only, None)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (run_dir / "manifest.json").write_text(json.dumps({**manifest, "trainer": "SFTTrainer"}))
    output = tmp_path / "exported"
    export_cli.main(["--adapter", str(run_dir), "--output", str(output)])

    card = ModelCard.load(output / "README.md")
    assert "sft" in card.data.tags and "grpo" not in card.data.tags
    assert card.data.to_dict()["rewards"] == {} and "none (supervised)" in card.text
    assert "python recipes/sft.py --config" in card.text
