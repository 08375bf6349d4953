"""`make demo` end to end at toy size: both experiments run every stage, the tables and the PNG appear, and the
reported numbers recompute from the per-example records."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import yaml
from conftest import run_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from vision_grpo.data import with_sft_completions
from vision_grpo.evaluation.pass_at_k import summarize_samples
from vision_grpo.evaluation.statistics import mcnemar_exact
from vision_grpo.recipe.arguments import RecipeError, TaskArguments

REPO = Path(__file__).resolve().parent.parent
# Result-file prefix of each experiment, its models and their column labels in the report.
EXPERIMENTS = {
    "": {"warm_start": "warm start", "grpo": "after GRPO"},
    "biased_": {"warm_start": "warm start", "grpo": "after GRPO", "sft_control": "SFT control (more SFT)"},
}


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags)


def assert_greedy_counts(result: dict) -> None:
    """The headline greedy numbers, counted again from the records by hand."""
    records, summary = result["records"], result["summary"]
    assert summary["n"] == len(records)
    assert summary["accuracy"] == _share([r["correct"] for r in records])
    assert summary["format_rate"] == _share([r["prediction"] is not None for r in records])
    for gold in {r["gold"] for r in records}:
        assert summary["accuracy_by_count"][gold] == _share([r["correct"] for r in records if r["gold"] == gold])


def assert_sampled_counts(result: dict) -> None:
    """pass@1 (mean share of right samples), pass@k (share of images with a right sample), by hand."""
    records, summary = result["records"], result["summary"]
    assert summary["n"] == len(records) and {len(r["correct"]) for r in records} == {summary["k"]}
    assert summary["pass_at_1"] == pytest.approx(sum(_share(r["correct"]) for r in records) / len(records))
    assert summary["pass_at_k"] == _share([any(r["correct"]) for r in records])
    for gold in {r["gold"] for r in records}:
        mine = [r for r in records if r["gold"] == gold]
        assert summary["pass_at_k_by_count"][gold] == _share([any(r["correct"]) for r in mine])


def test_pass_at_k_summary_on_chosen_records() -> None:
    records = [
        {"gold": "1", "correct": [True, False, False, False], "hit_limit": [False, False, True, False]},
        {"gold": "1", "correct": [False] * 4, "hit_limit": [False] * 4},
        {"gold": "2", "correct": [True] * 4, "hit_limit": [False] * 4},
    ]
    summary = summarize_samples(records)
    assert summary["n"] == 3 and summary["k"] == 4
    assert summary["pass_at_1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert summary["pass_at_k"] == pytest.approx(2 / 3)
    assert summary["pass_at_1_by_count"] == pytest.approx({"1": 0.125, "2": 1.0})
    assert summary["pass_at_k_by_count"] == {"1": 0.5, "2": 1.0}
    assert summary["hit_limit_rate"] == 1 / 12


def test_biased_demonstrations_follow_their_recipe_keys():
    """The second experiment's warm start: only the recipe's count is mislabelled, in about its share of rows,
    the same rows on every run; inconsistent keys are refused."""
    recipe = yaml.safe_load((REPO / "recipes/shapes/tiny_sft_biased.yaml").read_text(encoding="utf-8"))
    keys = {name: recipe[f"sft_mislabel_{name}"] for name in ("count", "as", "share")}
    rows = datasets.Dataset.from_dict(
        {"id": [f"1-{i}" for i in range(3000)], "answer": [1 + i % 3 for i in range(3000)]}
    )

    def shown():
        labelled = with_sft_completions(
            rows, recipe["sft_targets"], recipe["sft_target_weights"], **{f"mislabel_{k}": v for k, v in keys.items()}
        )
        return [(row["answer"], row["completion"][0]["content"][0]["text"]) for row in labelled]

    first = shown()
    assert first == shown()
    for answer, text in first:
        if answer != keys["count"]:
            assert text == f"The answer is \\boxed{{{answer}}}."
    wrong = [text == f"The answer is \\boxed{{{keys['as']}}}." for answer, text in first if answer == keys["count"]]
    assert abs(sum(wrong) / len(wrong) - keys["share"]) < 0.05
    right = [text == f"The answer is \\boxed{{{answer}}}." for answer, text in first if answer == keys["count"]]
    assert [not w for w in wrong] == right
    for bad in (
        {"sft_mislabel_count": 3},
        {"sft_mislabel_count": 3, "sft_mislabel_as": 3},
        {"sft_mislabel_share": 0.5},
    ):
        with pytest.raises(RecipeError):
            TaskArguments(**bad)
    with pytest.raises(RecipeError):
        TaskArguments(sft_mislabel_count=3, sft_mislabel_as=2, sft_mislabel_share=1.5)


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    command = ["-m", "vision_grpo.demo", "--quick", "--runs-dir", str(runs), "--results-dir", str(results)]
    process = run_script([*command, "--jobs", "2"], timeout=900)
    assert "TensorBoard: tensorboard --logdir" in process.stdout
    # Side by side, each stage's output went to its own file, not to the terminal.
    logs = sorted(path.name for path in (results / "logs").iterdir())
    assert logs == [
        "demo-biased-control.log",
        "demo-biased-grpo.log",
        "demo-biased-sft.log",
        "demo-grpo.log",
        "demo-sft.log",
    ]
    assert "'train_loss'" in (results / "logs" / "demo-grpo.log").read_text()  # the Trainer's last log line
    assert "'train_loss'" not in process.stdout + process.stderr
    check_demo_outputs(runs, results)

    # A second run, one stage at a time, reuses all five finished training stages instead of training again.
    again = run_script([*command, "--jobs", "1"], timeout=900)
    assert again.stdout.count("reusing") == 5
    assert "1 experiment(s) trained side by side" in again.stdout


def test_a_failed_stage_names_its_log_and_shows_its_end(tmp_path: Path) -> None:
    from vision_grpo.demo.stages import RUNNING, run_stage

    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('step 3 of 5')\nsys.exit('the reason it failed')\n")
    log = tmp_path / "logs" / "stage.log"
    with pytest.raises(SystemExit) as failed:
        run_stage(str(script), "recipes/shapes/tiny_sft.yaml", tmp_path / "runs", "x", [], False, log)
    message = str(failed.value)
    assert str(log) in message and message.rstrip().endswith("the reason it failed")
    assert "step 3 of 5" in message and not RUNNING


def check_demo_outputs(runs, results):
    """The report's tables and tests agree with the result files, whose summaries agree with their records."""
    report = (results / "report.md").read_text()
    lines = report.splitlines()
    assert "## Experiment 1: GRPO teaches the answer format" in lines
    assert "## Experiment 2: GRPO corrects biased demonstrations" in lines
    assert (results / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for prefix, models in EXPERIMENTS.items():
        loaded = {}
        for name in models:
            greedy, blank, sampled = (
                json.loads((results / f"{prefix}{name}{suffix}.json").read_text())
                for suffix in ("", "_blank", "_pass8")
            )
            for result in (greedy, blank):
                assert_greedy_counts(result)
            assert_sampled_counts(sampled)
            assert sampled["summary"]["k"] == 8 and sampled["metadata"]["decoding"]["temperature"] == 1.0
            assert [r["id"] for r in sampled["records"]] == [r["id"] for r in greedy["records"]]
            loaded[name] = (greedy, sampled)

        # Each experiment's table: one column per model, every cell from the result files.
        def row(name, cells):
            return f"| {name} | " + " | ".join(cells) + " |"

        assert "| | " + " | ".join(models.values()) + " |" in lines
        strict = [_pct(greedy["summary"]["accuracy"]) for greedy, _ in loaded.values()]
        assert row("accuracy (strict: last \\boxed{N} right)", strict) in lines
        pass_k = [_pct(sampled["summary"]["pass_at_k"]) for _, sampled in loaded.values()]
        assert row("pass@8 (some of 8 samples right)", pass_k) in lines
        by_count = [
            " · ".join(
                _pct(value)
                for value in (
                    greedy["summary"]["accuracy_by_count"]["3"],
                    sampled["summary"]["pass_at_1_by_count"]["3"],
                    sampled["summary"]["pass_at_k_by_count"]["3"],
                )
            )
            for greedy, sampled in loaded.values()
        ]
        threes = sum(1 for r in loaded["warm_start"][0]["records"] if r["gold"] == "3")
        assert row(f"3-shape images (n = {threes}): greedy · pass@1 · pass@8", by_count) in lines

        # McNemar: warm start -> GRPO; in the second experiment also control -> GRPO and warm start -> control.
        pairs = [("warm_start", "grpo")] + ([("sft_control", "grpo"), ("warm_start", "sft_control")] if prefix else [])
        for first, second in pairs:
            test = mcnemar_exact(loaded[first][0]["records"], loaded[second][0]["records"])
            assert (
                f"McNemar exact test on strict accuracy, {models[first]} → {models[second]}: {test['b']} images right "
                f"only with '{models[first]}', {test['c']} only with '{models[second]}', p = {test['p_value']:.3g}."
            ) in lines

    # The control continued the biased warm start, for as many token-passes as the GRPO stage made (4 per GRPO
    # token: generation, forward, backward x 2; 3 per SFT token), to within one of its own steps: read from the
    # tokens each run logged.
    control_dir = runs / "shapes" / "tiny_sft_biased" / "demo-biased-control"
    control = json.loads((control_dir / "manifest.json").read_text())
    assert control["argv"][control["argv"].index("--model_name_or_path") + 1].endswith("tiny_sft_biased/demo-biased")
    grpo_tokens = _logged_tokens(runs / "shapes" / "tiny_grpo_demo" / "demo-biased")
    control_tokens = _logged_tokens(control_dir)
    per_step = control_tokens / control["global_step"]
    assert abs(3 * control_tokens - 4 * grpo_tokens) <= 3 * per_step


def _logged_tokens(run_dir: Path) -> float:
    """The tokens TRL counted over a run (its last logged `num_tokens`, every step logged in the quick demo)."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars("train/num_tokens")[-1].value


def test_a_failed_stage_stops_the_stage_running_beside_it(tmp_path: Path, monkeypatch) -> None:
    """Side by side, the first experiment's warm start fails while the second's runs: the demo ends with the failure
    and the other stage is sent SIGTERM (our entry points then save a checkpoint) instead of running on to its end."""
    import signal

    from vision_grpo.demo import demo_command, stages

    fails, sleeps = tmp_path / "fails.py", tmp_path / "sleeps.py"
    fails.write_text("import sys, time\ntime.sleep(2)\nsys.exit('warm start failed')\n")
    sleeps.write_text("import time\ntime.sleep(60)\n")  # ends by itself (exit 0) if nobody stops it
    started: list = []
    real_popen = stages.subprocess.Popen

    def popen(command, **kwargs):
        process = real_popen(command, **kwargs)
        started.append((command[1], process))
        return process

    real_run_stage = stages.run_stage

    def run_stage(script, recipe, *args):  # the real run_stage, with a stand-in script for each experiment
        return real_run_stage(str(sleeps if "biased" in recipe else fails), recipe, *args)

    monkeypatch.setattr(stages.subprocess, "Popen", popen)
    monkeypatch.setattr(stages, "run_stage", run_stage)
    with pytest.raises(SystemExit, match="warm start failed"):
        demo_command.main(
            ["--jobs", "2", "--runs-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results")]
        )
    (sleeper,) = [process for script, process in started if script == str(sleeps)]
    assert sleeper.returncode == -signal.SIGTERM
    assert not stages.RUNNING
