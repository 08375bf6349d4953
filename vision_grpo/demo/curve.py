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
from vision_grpo.demo.stages import GRPO_PASSES, SFT_PASSES, Evaluated, Runs, evaluate, measured_passes, tokens_at
from vision_grpo.evaluation.statistics import mcnemar_exact

# The arms on the curve (result names in `Runs`) and the passes each makes over a token (None: as measured).
ARMS = {"grpo": GRPO_PASSES, "sft_control": SFT_PASSES, "grpo_variant": None}


def token_passes(experiment: Experiment, name: str, run_dir: Path, step: int) -> int:
    """An arm's compute up to `step`: with a second GRPO arm both GRPO arms as measured (`measured_passes`: the
    tokens generated in every round, the positions the training pass computed), else `ARMS`' passes per token."""
    if experiment.variant is not None or ARMS[name] is None:
        return measured_passes(run_dir, step)
    return ARMS[name] * tokens_at(run_dir, step)


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, model folder) of each saved checkpoint before the run's end, then the run's final model."""
    final = json.loads((run_dir / "manifest.json").read_text())["global_step"]
    saved = sorted((int(path.name.split("-")[1]), path) for path in run_dir.glob("checkpoint-*") if path.is_dir())
    return [(step, path) for step, path in saved if step < final] + [(final, run_dir)]


def compute_curve(
    experiment: Experiment, runs: Runs, models: list[Evaluated], results_dir: Path, extra: list[str]
) -> tuple[dict[str, list[dict[str, Any]]], dict[tuple[str, int], list[dict[str, Any]]]]:
    """Per arm, the warm start then every checkpoint: step, token-passes and strict held-out accuracy; and each
    checkpoint's per-image records, by (arm label, step)."""
    warm = models[0].greedy["summary"]["accuracy"]
    curves, records = {}, {}
    for run_dir, name, label, _ in runs:
        if name not in ARMS:
            continue
        points = [{"step": 0, "token_passes": 0, "accuracy": warm}]
        for step, model in checkpoints(run_dir):
            result_name = f"{experiment.results_prefix}curve_{name}_step{step}"
            result = evaluate(model, experiment.grpo_recipe, result_name, results_dir, extra, "none")
            passes = token_passes(experiment, name, run_dir, step)
            points.append({"step": step, "token_passes": passes, "accuracy": result["summary"]["accuracy"]})
            records[label, step] = result["records"]
        curves[label] = points
    (results_dir / f"{experiment.results_prefix}curve.json").write_text(json.dumps(curves, indent=1) + "\n")
    return curves, records


def equal_compute_test(
    curves: dict[str, list[dict[str, Any]]], records: dict[tuple[str, int], list[dict[str, Any]]]
) -> str:
    """McNemar's test of the first arm's last checkpoint against the second arm's checkpoint with the most compute
    not above it (so the second arm never has more compute than the first)."""
    (first, points), (second, other) = list(curves.items())[:2]
    end = points[-1]
    within = [p for p in other[1:] if p["token_passes"] <= end["token_passes"]]
    if not within:
        return f"No checkpoint of '{second}' has as little compute as '{first}' at its end: no test at equal compute."
    match = within[-1]
    test = mcnemar_exact(records[first, end["step"]], records[second, match["step"]])
    return (
        f"At equal compute, McNemar exact test on strict accuracy: '{first}' at step {end['step']} "
        f"({end['token_passes'] / 1e6:.2f} M token-passes, {100 * end['accuracy']:.1f}%) against '{second}' at step "
        f"{match['step']} ({match['token_passes'] / 1e6:.2f} M, {100 * match['accuracy']:.1f}%): {test['b']} images "
        f"right only with the first, {test['c']} only with the second, p = {test['p_value']:.3g}."
    )


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
    passes = (
        "M token-passes: tokens generated + 3 x positions trained"
        if experiment.variant is not None
        else f"M token-passes: GRPO {GRPO_PASSES}, SFT {SFT_PASSES} per token"
    )
    axis.set(xlabel=f"training after the warm start ({passes})")
    axis.set(ylabel="strict accuracy")
    axis.yaxis.set_major_formatter(PercentFormatter(1.0))
    axis.grid(alpha=0.3)
    axis.legend(loc="best")  # curves cross anywhere: the spot where they are not
    figure.tight_layout()
    figure.savefig(path, dpi=110)
