"""Experiment 4 (`make experiment-dynamic-sampling`): GRPO with and without dynamic sampling from Experiment 3's warm
start, both arms' checkpoints on the held-out images against their measured compute, end to end at toy size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_script

from vision_grpo.demo.experiments import EXPERIMENTS
from vision_grpo.demo.stages import measured_passes, tokens_at

(DYNAMIC,) = [e for e in EXPERIMENTS if e.key == "dynamic"]


@pytest.mark.slow
def test_quick_dynamic_sampling_experiment_compares_the_arms_by_their_compute(tmp_path: Path) -> None:
    runs, results = tmp_path / "runs", tmp_path / "results"
    command = ["-m", "vision_grpo.demo", "--quick", "--experiments", "dynamic"]
    run_script([*command, "--runs-dir", str(runs), "--results-dir", str(results)], timeout=600)

    report = (results / "report.md").read_text()
    assert f"## {DYNAMIC.title}" in report
    assert "McNemar exact test on strict accuracy, GRPO + dynamic sampling → after GRPO" in report
    assert "token-passes: generated tokens + 3 x positions trained" in report
    assert "At equal compute, McNemar" in report or "no test at equal compute" in report
    for png in ("dynamic.png", "dynamic_curve.png"):
        assert (results / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = json.loads((results / "dynamic_curve.json").read_text())
    plain, sampled = curves["after GRPO"], curves["GRPO + dynamic sampling"]
    variant = runs / "shapes/tiny_grpo_perception/demo-perception-dynamic"
    assert "dynamic_sampling_rounds: 3" in (variant / "recipe.yaml").read_text()
    assert [p["step"] for p in sampled] == [0, 1, 2]  # quick: a checkpoint every step
    # Compute as measured: every generated token once, every trained position three times; never less than the
    # generated tokens alone, and the same count the curve shows
    assert sampled[-1]["token_passes"] == measured_passes(variant, 2) >= tokens_at(variant, 2) > 0
    assert plain[0] == sampled[0] and plain[-1]["step"] == 2
