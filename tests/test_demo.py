"""`make demo` end to end at toy size: every stage runs, the table and the PNG appear, and the reported numbers
recompute from the per-example records."""

from __future__ import annotations

import json

import pytest
from conftest import run_script

from vision_grpo.eval.compare import mcnemar_exact
from vision_grpo.eval.scoring import summarize

TIMING = ("total_seconds", "samples_per_s")


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    process = run_script(
        ["-m", "vision_grpo.demo", "--quick", "--runs-dir", str(runs), "--results-dir", str(results)], timeout=900
    )
    report = (results / "report.md").read_text()
    assert "| accuracy (strict: last \\boxed{N} right) |" in report
    assert "strict accuracy with a blank image" in report
    assert "McNemar exact test" in report
    assert (results / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TensorBoard: tensorboard --logdir" in process.stdout

    loaded = {
        name: json.loads((results / f"{name}.json").read_text())
        for name in ("warm_start", "grpo", "warm_start_blank", "grpo_blank")
    }
    for result in loaded.values():
        recomputed = summarize(result["records"])
        reported = {k: v for k, v in result["summary"].items() if k not in TIMING}
        assert reported == recomputed
    test = mcnemar_exact(loaded["warm_start"]["records"], loaded["grpo"]["records"])
    assert f"{test['b']} items right only before, {test['c']} right only after, p = {test['p_value']:.3g}" in report
    before, after = (loaded[name]["summary"]["accuracy"] for name in ("warm_start", "grpo"))
    row = f"| accuracy (strict: last \\boxed{{N}} right) | {100 * before:.1f}% | {100 * after:.1f}% |"
    assert row in report.splitlines()

    # A second run reuses both finished training stages instead of training again.
    again = run_script(
        ["-m", "vision_grpo.demo", "--quick", "--runs-dir", str(runs), "--results-dir", str(results)], timeout=900
    )
    assert again.stdout.count("reusing") == 2
