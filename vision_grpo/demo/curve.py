"""Held-out accuracy against compute for GRPO and the SFT control: every checkpoint of each arm evaluated greedily on
the held-out images, placed at the token-passes it had made (the count that matches the control to GRPO), as a
table for the report, a JSON file and a PNG.

A comparison at one budget can hide that one arm was still rising or had already peaked; the curve shows both arms
from the warm start (0 token-passes) to the matched budget.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vision_grpo.demo.experiments import Experiment
from vision_grpo.demo.stages import GRPO_PASSES, SFT_PASSES, Evaluated, Runs, evaluate, tokens_at

# The arms on the curve (result names in `Runs`) and the passes each makes over a token.
ARMS = {"grpo": GRPO_PASSES, "sft_control": SFT_PASSES}


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, model folder) of each saved checkpoint before the run's end, then the run's final model."""
    final = json.loads((run_dir / "manifest.json").read_text())["global_step"]
    saved = sorted((int(path.name.split("-")[1]), path) for path in run_dir.glob("checkpoint-*") if path.is_dir())
    return [(step, path) for step, path in saved if step < final] + [(final, run_dir)]


def compute_curve(
    experiment: Experiment, runs: Runs, models: list[Evaluated], results_dir: Path, extra: list[str]
) -> dict[str, list[dict[str, Any]]]:
    """Per arm, the warm start then every checkpoint: step, token-passes and strict held-out accuracy."""
    warm = models[0].greedy["summary"]["accuracy"]
    curves = {}
    for run_dir, name, label, _ in runs:
        if name not in ARMS:
            continue
        points = [{"step": 0, "token_passes": 0, "accuracy": warm}]
        for step, model in checkpoints(run_dir):
            result_name = f"{experiment.results_prefix}curve_{name}_step{step}"
            result = evaluate(model, experiment.grpo_recipe, result_name, results_dir, extra, "none")
            passes = ARMS[name] * tokens_at(run_dir, step)
            points.append({"step": step, "token_passes": passes, "accuracy": result["summary"]["accuracy"]})
        curves[label] = points
    (results_dir / f"{experiment.results_prefix}curve.json").write_text(json.dumps(curves, indent=1) + "\n")
    return curves


def curve_table(curves: dict[str, list[dict[str, Any]]]) -> str:
    """The curve as the report's table: one row per checkpoint of each arm."""
    lines = ["| arm | step | token-passes (M) | held-out strict accuracy |", "|---|---|---|---|"]
    for label, points in curves.items():
        lines += [
            f"| {label} | {p['step']} | {p['token_passes'] / 1e6:.2f} | {100 * p['accuracy']:.1f}% |" for p in points
        ]
    return "\n".join(lines)


def plot_curve(experiment: Experiment, curves: dict[str, list[dict[str, Any]]], n: int, path: Path) -> None:
    """Held-out strict accuracy of each arm against its token-passes, both from the warm start."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    figure = Figure(figsize=(7, 4.5))
    axis = figure.subplots()
    for label, points in curves.items():
        xs = [p["token_passes"] / 1e6 for p in points]
        axis.plot(xs, [p["accuracy"] for p in points], marker="o", label=label)
    axis.set(title=f"{experiment.title}\nheld-out images (n = {n}), greedy, strict", ylim=(0, 1.02))
    axis.set(xlabel=f"training after the warm start (M token-passes: GRPO {GRPO_PASSES}, SFT {SFT_PASSES} per token)")
    axis.set(ylabel="strict accuracy")
    axis.yaxis.set_major_formatter(PercentFormatter(1.0))
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
