"""`eval/evaluate.py --write_held_out`: the held-out rows for lmms-eval are the rows the evaluator reads (ids, prompts,
the scored columns, each image's pixels), bound to the shipped task with the recipe's generation length; GeoQA's also
as a VLMEvalKit multiple-choice TSV; the task functions render our prompt and score with the task's own rule. lmms-eval
itself runs in `make test-lmms-eval` (tests_integrations/)."""

from __future__ import annotations

import base64
import csv
import io
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml
from PIL import Image
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.geoqa_fixture import write_fixture
from vision_grpo.data.vqa_fixtures import write_fixtures as write_vqa_fixtures
from vision_grpo.evaluation import evaluate
from vision_grpo.evaluation.eval_options import EvalArguments
from vision_grpo.evaluation.outside_evaluators import LMMS_EVAL_TASK, doc_to_messages, doc_to_text, process_results
from vision_grpo.models.loading import get_processor, max_pixels_of
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

SHAPES = ["--config", "recipes/shapes/tiny_cpu.yaml", "--shapes_eval_size", "6", "--max_pixels", "40000"]


def written_rows(folder: Path) -> datasets.Dataset:
    return datasets.load_dataset("parquet", data_files={"test": str(folder / "rows.parquet")})["test"]


def evaluated_rows(argv: list[str]) -> datasets.Dataset:
    """The rows `eval/evaluate.py` generates for with these arguments."""
    task_args, train_args, model_args, _ = parse_recipe((TaskArguments, GRPOConfig, ModelConfig, EvalArguments), argv)
    return get_dataset(task_args, "eval", max_pixels_of(get_processor(model_args, task_args)))


def test_the_written_rows_are_the_rows_the_evaluator_reads(tmp_path: Path) -> None:
    summary = evaluate.main([*SHAPES, "--max_new_tokens", "17", "--write_held_out", str(tmp_path / "shapes")])[
        "summary"
    ]
    rows, ours = written_rows(tmp_path / "shapes"), evaluated_rows(SHAPES)
    assert summary["rows"] == len(rows) == len(ours) == 6
    for written, row in zip(rows, ours, strict=True):
        assert written["id"] == row["id"] and written["prompt"] == row["prompt"] and written["task"] == "shapes"
        assert (written["answer"], written["shape"]) == (row["answer"], row["shape"])
        assert np.array_equal(np.asarray(written["image"]), np.asarray(row["image"]))  # PNG: lossless
    binding = yaml.safe_load(Path(summary["lmms_eval_task"]).read_text())
    assert binding["include"] == str(LMMS_EVAL_TASK) and binding["task"] == "vision_grpo_shapes"
    assert binding["dataset_kwargs"]["data_files"]["test"] == str((tmp_path / "shapes" / "rows.parquet").resolve())
    assert binding["generation_kwargs"]["max_new_tokens"] == 17
    assert "--model qwen2_5_vl " in summary["lmms_eval_command"]
    assert "min_pixels=3136,max_pixels=40000" in summary["lmms_eval_command"]  # the recipe's limits, overridden
    assert "vlmevalkit_tsv" not in summary  # a multiple-choice TSV only for GeoQA


def test_the_task_functions_render_our_prompt_and_score_with_the_task(tmp_path: Path) -> None:
    evaluate.main([*SHAPES, "--write_held_out", str(tmp_path)])
    doc = written_rows(tmp_path)[0]
    (message,) = doc_to_messages(doc)
    parts = [part["type"] for part in message["content"]]
    assert message["role"] == "user" and parts == [part["type"] for part in doc["prompt"][0]["content"]]
    image = next(part["url"] for part in message["content"] if part["type"] == "image")
    assert isinstance(image, Image.Image) and np.array_equal(np.asarray(image), np.asarray(doc["image"]))
    assert doc_to_text(doc) == next(part["text"] for part in doc["prompt"][0]["content"] if part["type"] == "text")
    right, wrong = f"\\boxed{{{doc['answer']}}}", f"\\boxed{{{doc['answer'] + 1}}}"
    assert process_results(doc, [right]) == {"accuracy": 1.0, "format_rate": 1.0}
    assert process_results(doc, [wrong]) == {"accuracy": 0.0, "format_rate": 1.0}
    assert process_results(doc, ["about five"]) == {"accuracy": 0.0, "format_rate": 0.0}


def test_geoqa_is_also_a_vlmevalkit_multiple_choice_tsv(tmp_path: Path) -> None:
    fixture = tmp_path / "geoqa.parquet"
    write_fixture(fixture)
    argv = ["--config", "recipes/geoqa/tiny_cpu.yaml", "--dataset_name", str(fixture), "--limit", "5"]
    summary = evaluate.main([*argv, "--write_held_out", str(tmp_path / "geoqa")])["summary"]
    with open(summary["vlmevalkit_tsv"], encoding="utf-8", newline="") as file:
        tsv = list(csv.DictReader(file, delimiter="\t"))
    source = datasets.load_dataset("parquet", data_files=str(fixture))["train"]
    by_id = {str(row["id"]): row for row in source}
    rows = written_rows(tmp_path / "geoqa")
    assert [row["id"] for row in tsv] == rows["id"] and len(tsv) == 5
    for line, row in zip(tsv, rows, strict=True):
        raw = by_id[line["id"]]
        assert line["question"] == raw["subject"] and [line[k] for k in "ABCD"] == raw["choices"]
        assert line["answer"] == "ABCD"[raw["label"]] == "ABCD"[row["label"]]
        image = Image.open(io.BytesIO(base64.b64decode(line["image"])))
        assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(row["image"]))


def test_a_family_lmms_eval_has_no_class_for_is_refused_before_writing(tmp_path: Path, monkeypatch) -> None:
    from vision_grpo.evaluation import outside_evaluators

    monkeypatch.setattr(outside_evaluators, "LMMS_EVAL_MODELS", {"qwen3_vl": "qwen3_vl"})
    with pytest.raises(ValueError, match="no lmms-eval model class is known for model type `qwen2_5_vl`"):
        evaluate.main([*SHAPES, "--write_held_out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_shipped_task_names_functions_the_utils_module_has() -> None:
    utils = (LMMS_EVAL_TASK.parent / "utils.py").read_text()
    text = LMMS_EVAL_TASK.read_text()
    for name in ("doc_to_messages", "doc_to_visual", "doc_to_text", "process_results"):
        assert f"!function utils.{name}" in text and name in utils
    assert "dataset_path: parquet" in text


def test_two_image_vqa_rows_keep_both_images_in_their_slots(tmp_path: Path) -> None:
    """A multi-image task (the generic VQA task's two-image fixture): an `images` column, one image per slot."""
    write_vqa_fixtures(tmp_path / "vqa")
    argv = ["--config", "recipes/vqa/tiny_two_image.yaml", "--dataset_name", str(tmp_path / "vqa" / "two_image")]
    evaluate.main([*argv, "--limit", "3", "--write_held_out", str(tmp_path / "out")])
    rows, ours = written_rows(tmp_path / "out"), evaluated_rows(argv)
    doc, row = rows[0], ours[0]
    assert len(doc["images"]) == 2 and doc["prompt"] == row["prompt"]
    for written, image in zip(doc["images"], row["images"], strict=True):
        assert np.array_equal(np.asarray(written), np.asarray(image))
    shown = [part["url"] for part in doc_to_messages(doc)[0]["content"] if part["type"] == "image"]
    assert [np.asarray(image).tobytes() for image in shown] == [np.asarray(image).tobytes() for image in row["images"]]
