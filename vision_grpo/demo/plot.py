"""The demo's one PNG: per experiment, GRPO's training curves (TensorBoard events) and every model's held-out results
as bars, all read from the run folders and result files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vision_grpo.demo.experiments import PASS_K, Experiment
from vision_grpo.demo.stages import Evaluated, run_scalars

CURVES = {
    "reward": "strict reward (boxed answer right)",
    "rewards/count_correct/mean": "lenient correctness",
    "rewards/count_format/mean": "format rate",
    "completions/clipped_ratio": "cut off at the limit",
}


def _bar_metrics(focus: int | None) -> dict[str, Any]:
    """What the bars show: name -> value of an `Evaluated`; with a mislabelled count, that count's own accuracy."""
    metrics = {"strict accuracy": lambda m: m.greedy["summary"]["accuracy"]}
    if focus is None:
        metrics["lenient accuracy"] = lambda m: m.greedy["summary"]["lenient_accuracy"]
        metrics["format rate"] = lambda m: m.greedy["summary"]["format_rate"]
    else:
        metrics[f"{focus} shapes: strict"] = lambda m: m.greedy["summary"]["accuracy_by_count"].get(str(focus))
        metrics[f"{focus} shapes: pass@1"] = lambda m: m.sampled["summary"]["pass_at_1_by_count"].get(str(focus))
    metrics[f"pass@{PASS_K}"] = lambda m: m.sampled["summary"]["pass_at_k"]
    metrics["strict, blank image"] = lambda m: m.blank["summary"]["accuracy"]
    return metrics


def plot(results: list[tuple[Experiment, Path, list[Evaluated]]], path: Path) -> None:
    """Per experiment: GRPO's training curves (TensorBoard events) and every model's held-out results as bars."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    figure = Figure(figsize=(13, 4.6 * len(results)))
    axes = figure.subplots(len(results), 2, squeeze=False)
    for (curves, bars), (experiment, grpo_run, models) in zip(axes, results, strict=True):
        events = run_scalars(grpo_run)
        for tag, label in CURVES.items():
            if f"train/{tag}" in events.Tags()["scalars"]:
                points = events.Scalars(f"train/{tag}")
                curves.plot([p.step for p in points], [p.value for p in points], label=label)
        curves.set(title=f"{experiment.title}\nGRPO training (batch means)", xlabel="GRPO step")
        curves.set(ylabel="share of the batch's completions", ylim=(-0.02, 1.02))
        curves.legend(fontsize=8, loc="center right")
        metrics = _bar_metrics(experiment.focus_count)
        width = 0.8 / len(models)
        for index, model in enumerate(models):
            xs = [x + (index - (len(models) - 1) / 2) * width for x in range(len(metrics))]
            values = [metric(model) for metric in metrics.values()]
            drawn = bars.bar(xs, [v or 0.0 for v in values], width=width, label=model.label)
            labels = ["–" if v is None else f"{100 * v:.0f}%" for v in values]
            bars.bar_label(drawn, labels=labels, fontsize=7, padding=1)
        bars.set_xticks(range(len(metrics)), list(metrics), fontsize=8)
        n = models[0].greedy["summary"]["n"]
        temperature = models[0].sampled["metadata"]["decoding"]["temperature"]
        bars.set(title=f"held-out images (n = {n}), greedy; pass@k: {PASS_K} samples at T = {temperature:g}")
        bars.set(ylabel="share of held-out images")
        bars.set(ylim=(0, 1.25), yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0])
        bars.legend(fontsize=8, loc="upper center", ncol=len(models))
        for axis in (curves, bars):
            axis.yaxis.set_major_formatter(PercentFormatter(1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
