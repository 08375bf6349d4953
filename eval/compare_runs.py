"""Compare training runs: a PNG grid of their main curves and a markdown table of final and best values.

    python eval/compare_runs.py runs/shapes/*/* [--output results/compare] [--smoothing 0.6]

Each argument is a run folder (`runs/<task>/<recipe>/<run>`: TensorBoard events plus the resolved `recipe.yaml`) or
a folder above run folders, which is searched. Curves come from TensorBoard's own event reader; the config comes
from each run's `recipe.yaml`, and only the keys whose values differ between the runs are shown, in the legend and
in the table. Writes `<output>.png` and `<output>.md`; headless (matplotlib's `Figure` without pyplot: Agg).
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import yaml
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator
from tensorboard.backend.event_processing import event_accumulator

logger = logging.getLogger("vision_grpo.compare_runs")

# Keys that differ between any two runs by construction; the run's label already says which run it is.
IDENTITY_KEYS = ("output_dir", "run_name")
UNSET = "(unset)"
LINE_STYLES = ("-", "--", "-.", ":")


@dataclass(frozen=True)
class Metric:
    """TensorBoard tags (a `fnmatch` pattern) and which value is best: `max`, `min`, or None (only the final)."""

    pattern: str
    best: Callable[[list[float]], float] | None


# The main curves, in grid and table order. Tags are transformers' TensorBoard names: `train/` + the logged key.
METRICS = (
    Metric("train/reward", max),
    Metric("train/rewards/*/mean", max),
    Metric("train/holdout/accuracy", max),
    Metric("train/holdout/lenient_accuracy", max),
    Metric("train/holdout/format_rate", max),
    Metric("train/holdout/mean_completion_tokens", None),
    Metric("train/completions/mean_length", None),
    Metric("train/completions/clipped_ratio", min),
    Metric("train/entropy", None),
    Metric("train/kl", None),
    Metric("train/train_runtime", None),
)


@dataclass
class Run:
    path: Path
    label: str
    config: dict[str, Any]
    scalars: dict[str, list[tuple[int, float]]]  # tag -> (step, value), by step


def find_runs(paths: list[str]) -> list[Path]:
    """Run folders: each path that holds event files, else the folders below it that do."""
    runs: list[Path] = []
    for name in paths:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if not path.is_dir():
            logger.warning("skipping %s: not a folder", path)  # e.g. a shell glob that also matched a file
            continue
        found = [path] if _has_events(path) else sorted({p.parent for p in path.rglob("events.out.tfevents.*")})
        runs += [run for run in found if run not in runs]
    if not runs:
        raise ValueError(f"no TensorBoard event files in or below {paths}")
    return runs


def _has_events(path: Path) -> bool:
    return any(path.glob("events.out.tfevents.*"))


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a run folder (all its event files), read by TensorBoard's `EventAccumulator`."""
    accumulator = event_accumulator.EventAccumulator(str(run_dir), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    series = {}
    for tag in accumulator.Tags()[event_accumulator.SCALARS]:
        by_step = {event.step: event.value for event in accumulator.Scalars(tag)}  # a resumed run: later value wins
        series[tag] = sorted(by_step.items())
    return series


def load_runs(paths: list[Path]) -> list[Run]:
    """Scalars and resolved recipe of each run, labelled by the shortest path ending that tells them apart."""
    labels = _unique_labels(paths)
    runs = []
    for path, label in zip(paths, labels, strict=True):
        recipe = path / "recipe.yaml"
        if not recipe.is_file():
            logger.warning("%s has no recipe.yaml: its config is unknown", path)
        config = yaml.safe_load(recipe.read_text(encoding="utf-8")) if recipe.is_file() else {}
        runs.append(Run(path, label, config or {}, read_scalars(path)))
    return runs


def _unique_labels(paths: list[Path]) -> list[str]:
    for depth in range(1, max(len(p.parts) for p in paths) + 1):
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def config_text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(config_text(v) for v in value) + "]"
    return str(value)


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """Config keys whose value is not the same in every run (a key set in only some runs differs), in recipe order."""
    keys = dict.fromkeys(key for config in configs for key in config if key not in IDENTITY_KEYS)
    return [key for key in keys if len({config_text(config.get(key, UNSET)) for config in configs}) > 1]


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average (its Smoothing slider), so the PNG matches the UI."""
    smoothed, last = [], 0.0
    for count, value in enumerate(values, start=1):
        last = last * weight + (1 - weight) * value
        smoothed.append(last / (1 - weight**count))
    return smoothed


def matching_tags(runs: list[Run]) -> list[tuple[str, Metric]]:
    """The tags of `METRICS` that some run logged, in `METRICS` order (a pattern's tags sorted)."""
    logged = sorted({tag for run in runs for tag in run.scalars})
    found: list[tuple[str, Metric]] = []
    for metric in METRICS:
        found += [(tag, metric) for tag in fnmatch.filter(logged, metric.pattern)]
    return found


def legend_label(run: Run, keys: list[str]) -> str:
    if not keys:
        return run.label
    return f"{run.label} ({', '.join(f'{key}={config_text(run.config.get(key, UNSET))}' for key in keys)})"


def plot_curves(runs: list[Run], keys: list[str], output: Path, smoothing: float) -> Path | None:
    """A grid of the metrics that form a curve (two or more points), one colour per run; raw values faint."""
    tags = [tag for tag, _ in matching_tags(runs) if any(len(run.scalars.get(tag, [])) > 1 for run in runs)]
    if not tags:
        logger.warning("no metric has two points yet: no curves drawn")
        return None
    columns = min(3, len(tags))
    rows = math.ceil(len(tags) / columns)
    legend_rows = math.ceil(len(runs) / 2)
    height = 3.0 * rows + 0.3 * legend_rows + 0.3
    figure = Figure(figsize=(4.6 * columns, height))
    axes = figure.subplots(rows, columns, squeeze=False)
    colors = [matplotlib.colormaps["tab10" if len(runs) <= 10 else "tab20"](i % 20) for i in range(len(runs))]
    styles = [LINE_STYLES[i % len(LINE_STYLES)] for i in range(len(runs))]  # runs that coincide stay visible
    for axis, tag in zip(axes.flat, tags, strict=False):  # the grid may have spare cells
        for run, color, style in zip(runs, colors, styles, strict=True):
            points = run.scalars.get(tag)
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            if smoothing > 0:
                axis.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            marker = "o" if len(steps) <= 20 else None
            smoothed = smooth(list(values), smoothing)
            axis.plot(steps, smoothed, color=color, linestyle=style, linewidth=1.8, marker=marker, markersize=3)
        axis.set_title(tag.removeprefix("train/"), fontsize=10)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=8)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.ticklabel_format(axis="y", useOffset=False)  # plain values, not "+6.082" offsets
        axis.grid(alpha=0.3)
    for axis in axes.flat[len(tags) :]:
        axis.axis("off")
    handles = [
        Line2D([], [], color=c, linestyle=s, linewidth=2, label=legend_label(r, keys))
        for r, c, s in zip(runs, colors, styles, strict=True)
    ]
    figure.legend(handles=handles, loc="lower center", ncol=min(len(runs), 2), frameon=False, fontsize=9)
    figure.tight_layout(rect=(0, (0.3 * legend_rows + 0.2) / height, 1, 1))
    path = output.parent / f"{output.name}.png"
    figure.savefig(path, dpi=110)
    return path


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def markdown_table(runs: list[Run], keys: list[str]) -> str:
    """Runs as columns; rows: the differing config keys (in backticks), steps, then final and best of each metric."""
    rows = [["", *(run.label for run in runs)], ["---"] * (len(runs) + 1)]
    rows += [[f"`{key}`", *(config_text(run.config.get(key, UNSET)) for run in runs)] for key in keys]
    last_steps = [max((points[-1][0] for points in run.scalars.values()), default=None) for run in runs]
    rows.append(["steps", *(_number(step) for step in last_steps)])
    for tag, metric in matching_tags(runs):
        values = [[value for _, value in run.scalars.get(tag, [])] for run in runs]
        name = tag.removeprefix("train/")
        rows.append([f"{name} (final)", *(_number(v[-1] if v else None) for v in values)])
        if metric.best is not None:
            best = [_number(metric.best(v) if v else None) for v in values]
            rows.append([f"{name} (best, {metric.best.__name__})", *best])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


def compare(paths: list[str], output: Path, smoothing: float = 0.6) -> tuple[Path | None, Path]:
    """Write `<output>.png` and `<output>.md` for the runs in `paths`; returns their paths (no PNG: no curves)."""
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    runs = load_runs(find_runs(paths))
    keys = differing_keys([run.config for run in runs])
    output.parent.mkdir(parents=True, exist_ok=True)
    png = plot_curves(runs, keys, output, smoothing)
    table = markdown_table(runs, keys)
    sources = "\n".join(f"- `{run.label}`: {run.path}" for run in runs)
    figure = f"![curves]({png.name})\n\n" if png else ""
    markdown = output.parent / f"{output.name}.md"
    markdown.write_text(f"# Run comparison\n\n{sources}\n\n{figure}{table}", encoding="utf-8")
    return png, markdown


def main(argv: list[str] | None = None) -> tuple[Path | None, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="Run folders, or folders above them.")
    parser.add_argument("--output", default="results/compare", help="Writes <output>.png and <output>.md.")
    parser.add_argument("--smoothing", type=float, default=0.6, help="TensorBoard-style smoothing in [0, 1).")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    png, markdown = compare(args.runs, Path(args.output), args.smoothing)
    print(markdown.read_text(encoding="utf-8"))
    print(f"wrote {markdown}" + (f" and {png}" if png else ""))
    return png, markdown


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
