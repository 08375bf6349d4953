"""`benchmarks/gpu_check.py`, the GPU check at real size, smoke-tested here at replica size on the CPU: the same
stages (build, GeoQA evaluation through `eval/evaluate.py`, one GRPO step of the seed's recipe through
`recipes/train.py`) in child processes, figures reported; and the real-size configurations' parameter counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_script
from tensorboard.backend.event_processing import event_accumulator

from vision_grpo.models.gated_deltanet import gated_deltanet_path
from vision_grpo.plan.build import SHIPPED_CONFIGS, parameter_counts

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402


def result_of(stdout: str) -> dict:
    return json.loads(stdout.split("RESULT gpu_check ", 1)[1].splitlines()[0])


@pytest.mark.slow
def test_the_gpu_check_runs_every_stage_at_toy_size(tmp_path: Path) -> None:
    """Both stages on the seed's model (the Qwen2.5-VL model goes through the same stage code; its real-size
    configuration is built below)."""
    args = ["benchmarks/gpu_check.py", "--toy", "--workdir", str(tmp_path), "--models", "qwen3.5-4b"]
    args += ["--eval-items", "3", "--eval-batch", "2", "--max-new-tokens", "4"]
    figures = result_of(run_script(args, timeout=600).stdout)
    assert figures["gpu"] is None and set(figures) == {"gpu", "qwen3.5-4b"}
    evaluation = figures["qwen3.5-4b"]["eval"]
    assert (evaluation["items"], evaluation["batch"], evaluation["device"]) == (3, 2, "cpu")
    # What it reports is what the evaluation wrote and what the training run logged, read back here on their own.
    result = json.loads((tmp_path / "qwen3.5-4b.json").read_text())
    assert result["metadata"]["max_new_tokens"] == 4 and 0 < evaluation["mean_completion_tokens"] <= 4
    for key in ("samples_per_s", "mean_completion_tokens", "hit_limit_rate"):
        assert evaluation[key] == result["summary"][key], key
    for key in ("train", "train_per_copy"):  # shared copies, then every copy on its own
        events = event_accumulator.EventAccumulator(str(tmp_path / key / "check"))
        events.Reload()
        (step_time,) = events.Scalars("train/step_time")
        assert figures["qwen3.5-4b"][key]["s_per_step"] == pytest.approx(step_time.value, rel=1e-6)


def test_the_real_size_configurations_are_the_shipped_hub_configs() -> None:
    """The check builds its real-size models from dimensions written in the benchmarks; the memory plan reads copies of
    the Hub's config.json (vision_grpo/plan/model_configs/). Qwen2.5-VL-3B has the plan's parameter count exactly, and
    Qwen3.5-4B's text model is the copy's key by key (its vision tower is the copy's only in the keys named here)."""
    figures = result_of(run_script(["benchmarks/gpu_check.py", "--dry-run"], timeout=300).stdout)
    assert figures["qwen3.5-4b"]["gated_deltanet_path"] == gated_deltanet_path()  # "torch" here: no fla, no CUDA
    assert figures["qwen2.5-vl-3b"]["parameters"] == shipped_parameters("Qwen--Qwen2.5-VL-3B-Instruct")
    shipped = json.loads((SHIPPED_CONFIGS / "Qwen--Qwen3.5-4B.json").read_text())
    differing = {key for key, value in gpu_check.QWEN3_5_4B_TEXT.items() if shipped["text_config"].get(key) != value}
    assert not differing, f"benchmarks/gpu_check.py's Qwen3.5-4B text config differs from the shipped copy: {differing}"
    vision = {key: shipped["vision_config"][key] for key in ("num_heads", "patch_size", "spatial_merge_size")}
    assert vision == {key: gpu_check.QWEN3_5_4B_VISION[key] for key in vision}


def shipped_parameters(name: str) -> int:
    """The parameters the memory plan counts (on the meta device) for its shipped copy of a Hub config."""
    from transformers import AutoConfig

    return parameter_counts(AutoConfig.from_pretrained(SHIPPED_CONFIGS / f"{name}.json"), 0, False, None)["total"]
