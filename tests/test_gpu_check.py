"""`benchmarks/gpu_check.py`, the GPU check at real size, smoke-tested here at replica size on the CPU: the same
stages (build, GeoQA evaluation through `eval/evaluate.py`, one GRPO step of the seed's recipe through
`recipes/train.py`) in child processes, figures reported; and the real-size configurations' parameter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_script


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
    assert 0 < evaluation["mean_completion_tokens"] <= 4 and evaluation["samples_per_s"] > 0
    assert json.loads((tmp_path / "qwen3.5-4b.json").read_text())["metadata"]["max_new_tokens"] == 4
    assert figures["qwen3.5-4b"]["train"]["s_per_step"] > 0


def test_the_real_size_configurations_have_the_published_sizes() -> None:
    """3.75 B for Qwen2.5-VL-3B-Instruct; 4.65 B for Qwen3.5-4B (its published dimensions as we read them)."""
    figures = result_of(run_script(["benchmarks/gpu_check.py", "--dry-run"], timeout=300).stdout)
    assert 3.70e9 < figures["qwen2.5-vl-3b"]["parameters"] < 3.80e9
    assert 4.55e9 < figures["qwen3.5-4b"]["parameters"] < 4.75e9
