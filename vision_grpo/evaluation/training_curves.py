"""Comparing training runs (the library of `eval/compare_runs.py` and of `recipes/sweep.py`'s comparison): run
folders found and read with TensorBoard's own event reader and their `recipe.yaml`, the keys that differ, a PNG grid
of the main curves per kind of run (GRPO, SFT) and a markdown table of final and best values.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import textwrap
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
UNSET = "(default)"  # recipe.yaml holds the keys a run set; a key it lacks had the default
LINE_STYLES = ("-", "--", "-.", ":")


@dataclass(frozen=True)
class Metric:
    """TensorBoard tags (a `fnmatch` pattern) and which value is best: `max`, `min`, or None (only the final).

    `curve=False`: a value logged once per run (its runtime), for the table only.
    """

    pattern: str
    best: Callable[[list[float]], float] | None
    curve: bool = True


# The main metrics of each kind of run, in grid and table order. Tags are transformers' TensorBoard names:
# `train/` + the logged key.
RUNTIME = Metric("train/train_runtime", min, curve=False)
METRICS = {
    "GRPO": (
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
        RUNTIME,
    ),
    "SFT": (
        Metric("train/loss", min),
        Metric("train/mean_token_accuracy", max),
        Metric("train/entropy", None),
        RUNTIME,
    ),
}


@dataclass
class Run:
    path: Path
    label: str
    config: dict[str, Any]
    scalars: dict[str, list[tuple[int, float]]]  # tag -> (step, value), by step
    trainer: str | None = None  # the trainer class the manifest records (written before training starts)

    @property
    def kind(self) -> str:
        """`GRPO` or `SFT`: the trainer the run's manifest names (so a run that crashed before logging anything is
        filed right), else what the trainer logged: TRL's GRPOTrainer logs a reward, and our held-out curves (GRPO
        only) start at step 0, before the first reward; SFTTrainer logs neither."""
        if self.trainer:
            return "SFT" if "SFT" in self.trainer else "GRPO"
        grpo = any(tag == "train/reward" or tag.startswith("train/holdout/") for tag in self.scalars)
        return "GRPO" if grpo else "SFT"


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
        runs.append(Run(path, label, config or {}, read_scalars(path), _trainer_of(path)))
    return runs


def _trainer_of(run_dir: Path) -> str | None:
    """The trainer class a run's `manifest.json` names (None for a run recorded before manifests named it)."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest.get("trainer") if isinstance(manifest, dict) else None


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


def group_by_kind(runs: list[Run]) -> dict[str, list[Run]]:
    """Runs by kind (GRPO first): an SFT loss and a GRPO reward on shared axes would compare nothing."""
    return {kind: [run for run in runs if run.kind == kind] for kind in METRICS if any(r.kind == kind for r in runs)}


def matching_tags(runs: list[Run]) -> list[tuple[str, Metric]]:
    """The tags of the runs' kind's metrics that some run logged, in `METRICS` order (a pattern's tags sorted)."""
    logged = sorted({tag for run in runs for tag in run.scalars})
    found: list[tuple[str, Metric]] = []
    for metric in METRICS[runs[0].kind]:
        found += [(tag, metric) for tag in fnmatch.filter(logged, metric.pattern)]
    return found


def _series(runs: list[Run], tag: str) -> list[list[float]]:
    return [[value for _, value in run.scalars.get(tag, [])] for run in runs]


def why_not_drawn(runs: list[Run], tag: str, drawn: list[str]) -> str | None:
    """None for a metric worth a panel; else why not: a single point, flat (one value everywhere), the same in every
    run, or the same series as a panel already drawn (`reward` = its only weighted part). A random-weight model's
    zero rewards once filled most of the grid with flat lines."""
    series = _series(runs, tag)
    if all(len(values) < 2 for values in series):
        return "one point"
    if len({value for values in series for value in values}) == 1:
        return "flat"
    if len(runs) > 1 and all(values == series[0] for values in series):
        return "the same in every run"
    twin = next((other for other in drawn if _series(runs, other) == series), None)
    return f"as {twin.removeprefix('train/')}" if twin else None


def legend_label(run: Run, keys: list[str]) -> str:
    """The run's label and its values of the differing keys it set; a key its name already shows is left out."""
    shown = [
        f"{key}={config_text(run.config[key])}" for key in keys if key in run.config and f"{key}=" not in run.label
    ]
    return f"{run.label} ({', '.join(shown)})" if shown else run.label


LEGEND_FONT = 9
SPARSE_POINTS = 10
CHARS_PER_INCH = 12  # at LEGEND_FONT points, with room to spare, so wrapped labels stay inside the figure


def wrapped_labels(labels: list[str], width_inches: float) -> tuple[list[str], int, float]:
    """Labels wrapped to fit the figure's width, the legend's columns, and its height in inches."""
    line_chars = int(width_inches * CHARS_PER_INCH) - 6  # the legend's line sample and padding
    columns = 2 if len(labels) > 1 and max(map(len, labels)) <= line_chars // 2 - 4 else 1
    wrapped = [textwrap.fill(label, line_chars // columns - 4 * (columns - 1)) for label in labels]
    lines_per_row = [
        max(label.count("\n") + 1 for label in wrapped[i : i + columns]) for i in range(0, len(wrapped), columns)
    ]
    return wrapped, columns, 0.2 * sum(lines_per_row) + 0.25


def curves_figure(runs: list[Run], keys: list[str], tags: list[str], smoothing: float) -> Figure:
    """A grid of `tags`, one colour per run, raw values faint, the legend below inside the figure."""
    columns = min(3, len(tags))
    rows = math.ceil(len(tags) / columns)
    width = 4.6 * max(columns, 2)
    labels, legend_columns, legend_height = wrapped_labels([legend_label(run, keys) for run in runs], width)
    height = 3.0 * rows + legend_height
    figure = Figure(figsize=(width, height))
    axes = figure.subplots(rows, columns, squeeze=False)
    colors = [matplotlib.colormaps["tab10" if len(runs) <= 10 else "tab20"](i % 20) for i in range(len(runs))]
    styles = [LINE_STYLES[i % len(LINE_STYLES)] for i in range(len(runs))]  # runs that coincide stay visible
    for axis, tag in zip(axes.flat, tags, strict=False):  # the grid may have spare cells
        for run, color, style in zip(runs, colors, styles, strict=True):
            points = run.scalars.get(tag)
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            # A sparse series (held-out accuracy every N steps: greedy, no sampling noise) is drawn as logged;
            # smoothing its few points would draw values it never had.
            weight = smoothing if len(steps) > SPARSE_POINTS else 0.0
            if weight > 0:
                axis.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            marker = "o" if len(steps) <= 20 else None
            smoothed = smooth(list(values), weight)
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
        Line2D([], [], color=c, linestyle=s, linewidth=2, label=label)
        for label, c, s in zip(labels, colors, styles, strict=True)
    ]
    figure.legend(handles=handles, loc="lower center", ncol=legend_columns, frameon=False, fontsize=LEGEND_FONT)
    figure.tight_layout(rect=(0, legend_height / height, 1, 1))
    return figure


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


def compare_group(runs: list[Run], output: Path, smoothing: float) -> tuple[Path | None, str]:
    """The PNG (None: nothing to draw) and the markdown section of runs of one kind."""
    keys = differing_keys([run.config for run in runs])
    skipped: dict[str, list[str]] = {}
    tags: list[str] = []
    for tag in [tag for tag, metric in matching_tags(runs) if metric.curve]:
        reason = why_not_drawn(runs, tag, tags)
        if reason is None:
            tags.append(tag)
        else:
            skipped.setdefault(reason, []).append(tag.removeprefix("train/"))
    png = output.parent / f"{output.name}.png" if tags else None
    if png:
        curves_figure(runs, keys, tags, smoothing).savefig(png, dpi=110)
    else:
        logger.warning("%s runs: no metric forms a curve that differs between them; no PNG", runs[0].kind)
    sources = "\n".join(f"- `{run.label}`: {run.path}" for run in runs)
    figure = f"![{runs[0].kind} curves]({png.name})\n\n" if png else ""
    left_out = "; ".join(f"{reason}: {', '.join(names)}" for reason, names in skipped.items())
    note = f"Not drawn ({left_out}).\n\n" if left_out else ""
    section = f"## {runs[0].kind} runs ({len(runs)})\n\n{sources}\n\n{figure}{note}{markdown_table(runs, keys)}"
    return png, section


def compare(paths: list[str], output: Path, smoothing: float = 0.6) -> tuple[list[Path], Path]:
    """Write `<output>.md` and a PNG per kind of run (`<output>.png` for one kind, else `<output>_<kind>.png`)."""
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    groups = group_by_kind(load_runs(find_runs(paths)))
    output.parent.mkdir(parents=True, exist_ok=True)
    pngs, sections = [], []
    for kind, runs in groups.items():
        prefix = output if len(groups) == 1 else output.with_name(f"{output.name}_{kind.lower()}")
        png, section = compare_group(runs, prefix, smoothing)
        pngs += [png] if png else []
        sections.append(section)
    markdown = output.parent / f"{output.name}.md"
    markdown.write_text("# Run comparison\n\n" + "\n".join(sections), encoding="utf-8")
    return pngs, markdown


def write_comparison(paths: list[str], output: Path, smoothing: float = 0.6) -> tuple[list[Path], Path]:
    """`compare`, then the markdown printed and the files written named: what `eval/compare_runs.py` and a sweep's
    end print."""
    pngs, markdown = compare(paths, output, smoothing)
    print(markdown.read_text(encoding="utf-8"))
    print(f"wrote {', '.join(str(path) for path in [markdown, *pngs])}")
    return pngs, markdown
