"""HParams in TensorBoard and the held-out accuracy callback (vision_grpo/training/holdout.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import REPO, run_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import api_pb2, metadata
from transformers import TrainerControl, TrainerState
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.evaluation.batches import images_of
from vision_grpo.evaluation.evaluator import Evaluator
from vision_grpo.evaluation.scoring import summarize
from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.rewards import get_reward_funcs
from vision_grpo.training.holdout import HoldoutAccuracy
from vision_grpo.training.hparams import TensorBoardHParams, recipe_hparams

RECIPE = str(REPO / "recipes" / "shapes" / "tiny_cpu.yaml")


def parse(*overrides: str):
    return parse_recipe((TaskArguments, GRPOConfig, ModelConfig), ["--config", RECIPE, *overrides])


def test_recipe_hparams_are_typed_knobs():
    task_args, training_args, model_args = parse("--learning_rate", "4e-5", "--loss_type", "grpo")
    hparams = recipe_hparams(task_args, training_args, model_args)
    assert all(isinstance(value, (bool, int, float, str)) for value in hparams.values())
    assert hparams["learning_rate"] == 4e-5 and hparams["loss_type"] == "grpo" and hparams["lora_r"] == 8
    assert hparams["model"] == "vision-grpo/tiny-qwen2.5-vl" and hparams["vision_tower"] == "freeze"
    assert hparams["reward_weight/count_description"] == 0.5 and hparams["reward_weight/count_format"] == 0.0
    assert "vision_lr_scale" not in hparams
    full = recipe_hparams(*parse("--use_peft", "false", "--vision_tower", "scaled_lr", "--vision_lr_scale", "0.2"))
    assert full["lora_r"] == 0 and full["vision_lr_scale"] == 0.2


def hparams_plugin_data(run_dir: Path) -> dict[str, object]:
    """The HParams plugin's tags in a run folder, parsed with the plugin's own metadata readers."""
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    found = {}
    for tag in accumulator.Tags()["tensors"]:
        plugin = accumulator.SummaryMetadata(tag).plugin_data
        if plugin.plugin_name == metadata.PLUGIN_NAME:
            found[tag] = metadata.parse_session_start_info_plugin_data(plugin.content) if "start" in tag else plugin
    return found


def test_hparams_session_is_written_at_start_and_closed_at_end(tmp_path):
    callback = TensorBoardHParams(tmp_path, {"learning_rate": 4e-5, "loss_type": "dapo", "lora_on_vision": False})
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(None, state, control)
    start = hparams_plugin_data(tmp_path)[metadata.SESSION_START_INFO_TAG]
    assert start.hparams["learning_rate"].number_value == 4e-5
    assert start.hparams["loss_type"].string_value == "dapo"
    assert start.hparams["lora_on_vision"].bool_value is False
    callback.on_train_end(None, state, control)
    end = hparams_plugin_data(tmp_path)[metadata.SESSION_END_INFO_TAG]
    assert metadata.parse_session_end_info_plugin_data(end.content).status == api_pb2.STATUS_SUCCESS
    assert metadata.EXPERIMENT_TAG not in hparams_plugin_data(tmp_path)  # TensorBoard merges columns of all runs


def test_hparams_are_written_by_the_main_process_only(tmp_path):
    callback = TensorBoardHParams(tmp_path, {"learning_rate": 1.0})
    state = TrainerState(is_world_process_zero=False)
    callback.on_train_begin(None, state, TrainerControl())
    callback.on_train_end(None, state, TrainerControl())
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def holdout_setup(tiny_model_path):
    task_args, training_args, model_args = parse("--shapes_eval_size", "6", "--max_completion_length", "8")
    processor = get_processor(model_args, task_args)
    model = load_model(model_args)
    rows = get_dataset(task_args, "eval", max_pixels_of(processor))
    rewards = get_reward_funcs(task_args.reward_funcs, context={"eos_token_ids": [processor.tokenizer.eos_token_id]})
    args = SimpleNamespace(chat_template_kwargs=None, max_completion_length=8, per_device_eval_batch_size=4)
    trainer = SimpleNamespace(model=model, processing_class=processor, args=args)
    return trainer, rows, rewards


@pytest.mark.slow
@pytest.mark.parametrize("training", [True, False])
def test_holdout_metrics_are_the_evaluators_and_keep_the_mode(holdout_setup, training):
    trainer, rows, rewards = holdout_setup
    trainer.model.train(training)
    metrics = HoldoutAccuracy(trainer, rows, "shapes", rewards, every=2, max_new_tokens=8).measure()
    assert trainer.model.training is training

    evaluator = Evaluator(trainer.model, trainer.processing_class, "shapes", rewards, {})
    records = []
    for batch in (rows.select(range(4)), rows.select(range(4, 6))):  # the callback's batches of 4
        rows_read = list(batch)  # the rows as a batch reads them, images drawn or decoded at access
        generated = evaluator.generate(rows_read, [images_of(row) for row in rows_read], 8)
        records += [evaluator.record(row, result) for row, result in zip(rows_read, generated, strict=True)]
    summary = summarize(records)
    for key in ("accuracy", "format_rate", "mean_completion_tokens", "hit_limit_rate", "distinct_output_rate"):
        assert metrics[key] == pytest.approx(summary[key]), key
    assert set(metrics) >= {f"rewards/{name}" for name in summary["rewards"]}
    assert 0 < metrics["mean_completion_tokens"] <= 8


def test_holdout_needs_a_positive_interval(holdout_setup):
    trainer, rows, rewards = holdout_setup
    with pytest.raises(ValueError, match="at least 1"):
        HoldoutAccuracy(trainer, rows, "shapes", rewards, every=0, max_new_tokens=8)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def tensorboard_session_groups(logdir: Path, timeout: float = 120) -> list[dict]:
    """Start `tensorboard --logdir` and ask its HParams plugin for the session groups, as the HParams view does."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
    request = {"experimentName": "", "startIndex": 0, "sliceSize": 100, "allowedStatuses": statuses, "colParams": []}
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                groups = _post(f"http://127.0.0.1:{port}/data/plugin/hparams/session_groups", request)
                if groups.get("sessionGroups"):
                    return groups["sessionGroups"]
            except OSError:
                pass  # not listening yet, or still loading the event files
            if time.monotonic() > deadline or server.poll() is not None:
                raise AssertionError(f"TensorBoard showed no HParams sessions for {logdir} within {timeout} s")
            time.sleep(1)
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
def test_training_logs_holdout_curves_and_tensorboard_shows_hparams(tmp_path):
    logdir = tmp_path / "runs"
    run_script(
        [
            "recipes/train.py",
            "--config", RECIPE,
            "--output_dir", str(logdir / "shapes" / "tiny_cpu"),
            "--run_name", "hp",
            "--learning_rate", "3e-4",
            "--max_steps", "2",
            "--save_steps", "100",
            "--shapes_train_size", "16",
            "--shapes_eval_size", "4",
            "--holdout_eval_steps", "1",
            "--holdout_eval_size", "3",
        ],
        timeout=600,
    )  # fmt: skip
    accumulator = EventAccumulator(str(logdir / "shapes" / "tiny_cpu" / "hp"), size_guidance={"scalars": 0})
    accumulator.Reload()
    steps = {tag: [event.step for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    assert steps["train/holdout/accuracy"] == [0, 1, 2]
    assert steps["train/holdout/rewards/count_correct"] == [0, 1, 2]
    assert steps["train/reward"] == [1, 2]  # the held-out log at the same step did not swallow TRL's metrics
    assert all(0 <= event.value <= 1 for event in accumulator.Scalars("train/holdout/format_rate"))
    decoding = json.loads((logdir / "shapes" / "tiny_cpu" / "hp" / "holdout_decoding.json").read_text())
    recipe_length = yaml.safe_load(Path(RECIPE).read_text())["max_completion_length"]
    assert decoding["do_sample"] is False and decoding["max_new_tokens"] == recipe_length  # the evaluator's rule

    (group,) = tensorboard_session_groups(logdir)
    assert group["hparams"]["learning_rate"] == pytest.approx(3e-4)
    assert group["hparams"]["loss_type"] == "dapo" and group["hparams"]["lora_r"] == 8
    (session,) = group["sessions"]
    assert session["name"] == "shapes/tiny_cpu/hp" and session["status"] == "STATUS_SUCCESS"
    finals = {value["name"]["tag"]: value for value in session["metricValues"]}
    assert finals["train/holdout/accuracy"]["trainingStep"] == 2
    assert finals["train/reward"]["trainingStep"] == 2
