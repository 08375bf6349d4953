"""The benchmarks run and print their figures (smallest settings; nothing here is timed or compared to a threshold),
and the two measuring helpers they all rely on read what they claim to read."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_script

sys.path.insert(0, str(REPO / "benchmarks"))
from common import read_step_log, report, run_measured  # noqa: E402
from run_all import BENCHMARKS  # noqa: E402


def _numbers(value) -> list[float]:
    """Every number inside a JSON value."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def test_run_measured_reports_each_child_own_peak_memory() -> None:
    """A big child followed by a small one: the small one's peak must not inherit the big one's (it would with
    RUSAGE_CHILDREN, which keeps the largest child ever waited for), nor this (possibly large) test process's.
    Both children stay alive long enough to be read (the reader polls every 50 ms)."""
    big = run_measured(
        ["-c", "import time; x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(0.3)"]
    )
    ballast = bytearray(600 * 2**20)  # this process grows: a child forked now must not report it as its own
    ballast[::4096] = b"1" * len(ballast[::4096])
    small = run_measured(["-c", "import time; time.sleep(0.3)"])
    del ballast
    assert big.returncode == small.returncode == 0
    assert big.peak_rss_mib > 300
    assert small.peak_rss_mib < big.peak_rss_mib - 250
    assert big.cpu_s >= 0 and big.wall_s > 0


def test_rss_at_reads_resident_memory_then_not_the_peak() -> None:
    """A child that grows by 300 MiB and shrinks back: its RSS when it held the memory is 300 MiB above its RSS
    before and after (the peak would say 300 MiB more at every time), which `data_scale.py --train-epochs` relies on
    to compare memory after 50 steps with memory at the end."""
    child = (
        "import time, sys; time.sleep(0.4); print(time.time(), flush=True); x = bytearray(300 * 2**20); "
        "x[::4096] = b'1' * len(x[::4096]); time.sleep(0.4); print(time.time(), flush=True); del x; "
        "print(time.time(), flush=True); time.sleep(0.6)"
    )
    done = run_measured(["-c", child])
    before, holding, after = (float(line) for line in done.output.split())
    assert done.returncode == 0
    assert done.rss_at(holding) - done.rss_at(before) > 250
    assert done.rss_at(holding) - done.rss_at(after + 0.2) > 250
    assert done.peak_rss_mib >= done.rss_at(holding)


def test_read_step_log_pairs_each_step_with_its_log_time(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "runs" / "x"))
    step_times = [5.0, 1.5, 1.25, 1.0]
    for step, value in enumerate(step_times, start=1):
        writer.add_scalar("train/loss", 0.0, step)
        writer.add_scalar("train/num_tokens", 100.0 * step, step)
        writer.add_scalar("train/step_time", value, step, walltime=1000.0 + 10 * step)
    writer.close()
    log = read_step_log(tmp_path)
    assert log.step_times == step_times
    assert log.tokens == [100.0, 200.0, 300.0, 400.0]
    assert log.wall_times == [1010.0, 1020.0, 1030.0, 1040.0]
    assert log.step_periods() == [10.0, 10.0, 10.0]
    assert log.first_step_start() == 1010.0 - 5.0


def test_a_benchmarks_json_goes_into_a_folder_made_for_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`--json results/x.json` on a fresh clone, which has no results/ (before: FileNotFoundError after the run)."""
    report("x", {"steps": 2}, str(tmp_path / "results" / "x.json"))
    assert json.loads((tmp_path / "results" / "x.json").read_text()) == {"steps": 2}
    assert capsys.readouterr().out == 'RESULT x {"steps": 2}\n'


def test_overhead_pairs_that_did_different_work_are_refused() -> None:
    """Ours / bare TRL compares times only if both sides generated the same tokens at every step."""
    from train_overhead import check_same_work

    check_same_work({"ours": [864.0, 1709.0], "bare": [864.0, 1709.0]})
    with pytest.raises(RuntimeError, match="not like for like: at step 2 ours had seen 1709.0 tokens, bare TRL 1722.0"):
        check_same_work({"ours": [864.0, 1709.0], "bare": [864.0, 1722.0]})


@pytest.mark.slow
def test_run_all_quick_runs_every_benchmark_and_prints_the_summary(tmp_path: Path) -> None:
    process = run_script(["benchmarks/run_all.py", "--quick", "--out", str(tmp_path)], timeout=1800)
    for name in BENCHMARKS:
        assert f"=== {name} ===" in process.stdout
        figures = json.loads((tmp_path / f"{name}.json").read_text())
        numbers = _numbers(figures)
        assert numbers and all(math.isfinite(n) and n >= 0 for n in numbers), name
    overhead = json.loads((tmp_path / "train_overhead.json").read_text())
    assert overhead["s_per_step"]["ours"] > 0 and overhead["s_per_step"]["bare"] > 0
    assert overhead["load"].startswith("load average")
    # Each ratio is ours over bare TRL (one pair here, so the median of the pairs' ratios is that pair's).
    assert overhead["pairs"] == 1
    for key, figure in overhead.items():
        if isinstance(figure, dict) and "ratio" in figure:
            assert figure["ratio"] == pytest.approx(figure["ours"] / figure["bare"], rel=1e-9), key
    assert overhead["startup_s"]["ours"] > 0 and overhead["peak_rss_mib"]["ours"] > 100
    evaluation = json.loads((tmp_path / "eval_throughput.json").read_text())
    assert evaluation["base batch 8"]["same_answers_as_batch_1"] == evaluation["items"]  # batching changes nothing
    base = evaluation["base batch 1"]["samples_per_s"]  # one round: its ratios are the figures' ratios
    assert evaluation["rounds"] == 1
    assert evaluation["batching_speedup"] == pytest.approx(evaluation["base batch 8"]["samples_per_s"] / base)
    scaling = json.loads((tmp_path / "memory_scaling.json").read_text())
    assert len(scaling["train"]) >= 2 and scaling["evaluator"]["peak_rss_mib"] > 100
    packed = json.loads((tmp_path / "training_pass_costs.json").read_text())
    assert packed["tokens_per_signal"]["new"] < packed["tokens_per_signal"]["before"]
    assert packed["max_log_prob_difference"] <= 1e-5 and packed["max_weight_difference"] <= 1e-5
    for line in (
        "training tokens computed per token with signal: new ",
        "training pass time before / new: ",
        "step time before / new: ",
        "peak memory before / new: ",
        "max |log-prob difference|: ",
        "Qwen2.5-VL: training pass before / new: ",
    ):
        assert f"\n{line}" in process.stdout, line
    summary = process.stdout.split("=== summary", 1)[1]
    for figure in ("ours / bare TRL", "batched / one at a time", "peak RSS, evaluator", "dataset preparation"):
        assert figure in summary
