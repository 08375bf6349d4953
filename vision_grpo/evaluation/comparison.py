"""Comparing evaluation results of the same items (the library of `eval/compare.py`): result files read and checked
(each given once, their summary what their records give, their items the same), the comparison, significance,
grounding and breakdown tables as one markdown report, the bar chart (matplotlib's `Figure`, no pyplot), and the
outputs checked before either is written (an earlier comparison is replaced only with `--overwrite`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from vision_grpo.evaluation.scoring import summarize
from vision_grpo.evaluation.statistics import ItemMismatch, ResultError, mcnemar_exact

NONE = "–"
# What makes two runs "the same model" for the grounding check: everything but the images shown.
GROUNDING_KEYS = ("model", "adapter", "max_new_tokens")
DEFAULT_REPORT = "results/eval_compare.md"
REPORT_START = "## Evaluation comparison\n"  # how every report `report` writes begins
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TICK_FONT = 8
# Characters of TICK_FONT-point DejaVu Sans per inch of a bar group, with room to spare between neighbours.
TICK_CHARS_PER_INCH = 14
NAME_PIECES = re.compile(r"[^_\-/]+[_\-/]*|[_\-/]+")  # `step100_` `eval`: break after a separator


class OutputExists(ValueError):
    """A report or chart path that holds a file this comparison must not replace."""


def check_distinct(paths: list[Path]) -> None:
    """Refuse a result file given twice, however it is spelled (`./a.json`, a symbolic or hard link to it): compared
    with itself it differs in nothing, and the table and McNemar's test would report that as a finding."""
    for later in range(1, len(paths)):
        for earlier in range(later):
            first, again = paths[earlier], paths[later]
            if first.exists() and again.exists() and os.path.samefile(first, again):
                which = f"{first} and {again} are one file" if first != again else f"{first} is given twice"
                raise ResultError(
                    f"result files {earlier + 1} and {later + 1}: {which}; compared with itself a result differs in "
                    "nothing: give each result file once"
                )


def plot_path(output: str | Path) -> Path:
    """The chart beside the report: `--output`'s name with `.png`, so two comparisons keep their charts apart."""
    return Path(output).with_suffix(".png")


def _is_earlier_output(path: Path, chart: bool) -> bool:
    """`path` holds what this command writes there: a PNG for the chart, else a report that starts as `report`'s."""
    with path.open("rb") as existing:
        start = existing.read(len(REPORT_START.encode()))
    return start.startswith(PNG_SIGNATURE) if chart else start == REPORT_START.encode()


def check_outputs(report_path: Path, chart_path: Path, chart_given: bool, overwrite: bool) -> None:
    """Before anything is written: the report and the chart are two files, neither a folder; an existing one is
    replaced only with `overwrite`, and only if it is an earlier comparison's (a typo must not turn `--overwrite`
    onto notes or a figure of another kind). `chart_given`: the chart's path came from `--plot`, not `--output`."""
    if report_path.resolve() == chart_path.resolve():
        raise OutputExists(
            f"the report (--output) and the chart (--plot) would both be {report_path}: give --output a .md name, "
            "or --plot another"
        )
    chart = f"--plot {chart_path}" if chart_given else f"the chart {chart_path} (--output's name with .png)"
    for shown, path, is_chart in ((f"--output {report_path}", report_path, False), (chart, chart_path, True)):
        if path.is_dir():
            raise OutputExists(f"{shown} is a folder: name a file in it, e.g. --output {path / 'eval_compare.md'}")
        if not path.exists():
            continue
        flag = "--plot" if is_chart and chart_given else "--output"
        if not _is_earlier_output(path, is_chart):
            kind = "a PNG" if is_chart else f"a report of eval/compare.py (it starts `{REPORT_START.strip()}`)"
            raise OutputExists(
                f"{shown} exists and is not {kind}: it is not replaced, --overwrite or not; choose another {flag}"
            )
        if not overwrite:
            raise OutputExists(
                f"{shown} holds an earlier comparison: pass --overwrite to replace it, or choose another {flag}"
            )


def load_result(path: str | Path) -> dict[str, Any]:
    """A result file of `eval/evaluate.py`; a clear error for anything else (e.g. a `.partial.jsonl`)."""
    path = Path(path)
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ResultError(f"cannot read result file {path}: {error}") from error
    if not isinstance(result, dict) or not {"summary", "records"} <= result.keys():
        raise ResultError(f"{path} is not an evaluation result (it needs `summary` and `records`)")
    check_summary(result, path)
    return result


def check_summary(result: dict[str, Any], path: Path) -> None:
    """Refuse a result whose summary is not what its records give (an edited or damaged file): the tables read the
    summary, the paired tests the records, and the two must tell one story."""
    try:
        recomputed = summarize(result["records"])
    except (KeyError, TypeError, ZeroDivisionError) as error:
        raise ResultError(f"{path}: its records cannot be summarised ({type(error).__name__}: {error})") from None
    stored = result["summary"]
    differing = [key for key, value in recomputed.items() if not _same(stored.get(key), value)]
    if differing:
        shown = "; ".join(
            f"summary.{key} is {stored.get(key)!r}, its records give {recomputed[key]!r}" for key in differing
        )
        raise ResultError(f"{path}: the summary disagrees with the records ({shown}); re-run eval/evaluate.py for it")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def check_same_items(results: list[dict[str, Any]], names: list[str]) -> None:
    """Refuse results whose items differ from the first's: other ids, or other gold answers under the same ids."""
    reference = {r["id"]: r["gold"] for r in results[0]["records"]}
    for result, name in zip(results[1:], names[1:], strict=True):
        gold = {r["id"]: r["gold"] for r in result["records"]}
        only_first = sorted(reference.keys() - gold.keys())
        only_this = sorted(gold.keys() - reference.keys())
        if only_first or only_this:
            raise ItemMismatch(
                f"{names[0]} and {name} hold different items: {len(only_first)} only in {names[0]} "
                f"(e.g. {only_first[:3]}), {len(only_this)} only in {name} (e.g. {only_this[:3]})"
            )
        changed = sorted(i for i in reference if reference[i] != gold[i])
        if changed:
            example = changed[0]
            raise ItemMismatch(
                f"{names[0]} and {name} have the same ids but {len(changed)} different gold answers "
                f"(e.g. {example}: {reference[example]!r} vs {gold[example]!r}): they come from different data"
            )


def _percent(value: float | None) -> str:
    return NONE if value is None else f"{100 * value:.1f}%"


def _points(value: float | None, reference: float | None) -> str:
    return NONE if value is None or reference is None else f"{100 * (value - reference):+.1f}"


def _number(value: float | None, digits: int = 1, unit: str = "") -> str:
    return NONE if value is None else f"{value:.{digits}f}{unit}"


def _reward(value: float | None) -> str:
    return _number(value, 3)


def _p_value(p: float) -> str:
    return f"{p:.3g}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines) + "\n"


def _conditional(records: list[dict[str, Any]]) -> str:
    """Correct among formatted answers, with its counts (the seed writes 71 / 75 = 94.7%)."""
    formatted = [r for r in records if r["prediction"] is not None]
    if not formatted:
        return NONE
    correct = sum(1 for r in formatted if r["correct"])
    return f"{correct}/{len(formatted)} = {100 * correct / len(formatted):.1f}%"


def comparison_table(results: list[dict[str, Any]], names: list[str]) -> str:
    """The seed's table, extended: accuracy, format rate and their change against the first run, accuracy among
    formatted answers, unparsed answers (how many hit the token limit), mean tokens, speed and time. Refuses
    results of different items (`ItemMismatch`)."""
    check_same_items(results, names)
    lenient = all("lenient_accuracy" in result["summary"] for result in results)
    header = ["Run", "n", "Accuracy", "Δ acc. (pp)"]
    header += ["Lenient acc."] if lenient else []
    header += ["Format rate", "Δ format (pp)", "Acc. among formatted", "Unparsed (hit limit)"]
    header += ["Mean tokens (all / formatted)", "Samples/s", "Total time"]
    first = results[0]["summary"]
    rows = []
    for result, name in zip(results, names, strict=True):
        s = result["summary"]
        row = [name, str(s["n"]), _percent(s["accuracy"]), _points(s["accuracy"], first["accuracy"])]
        row += [_percent(s["lenient_accuracy"])] if lenient else []
        row += [
            _percent(s["format_rate"]),
            _points(s["format_rate"], first["format_rate"]),
            _conditional(result["records"]),
            f"{s['unparsed']} ({s['unparsed_hit_limit']})",
            f"{_number(s['mean_completion_tokens'])} / {_number(s['mean_completion_tokens_formatted'])}",
            _number(s.get("samples_per_s"), 2),
            _number(s.get("total_seconds"), 1, " s"),
        ]
        rows.append(row)
    return _markdown(header, rows)


def significance_table(results: list[dict[str, Any]], names: list[str]) -> str:
    """McNemar's exact test of every run against the first."""
    rows = []
    for result, name in zip(results[1:], names[1:], strict=True):
        test = mcnemar_exact(results[0]["records"], result["records"])
        rows.append([name, str(test["b"]), str(test["c"]), _p_value(test["p_value"])])
    header = ["Run", f"only {names[0]} right", "only this run right", "p (McNemar, exact)"]
    return _markdown(header, rows)


def _matches(control: dict[str, Any], real: dict[str, Any]) -> bool:
    return real.get("image_control", "none") == "none" and all(
        control.get(key) == real.get(key) for key in GROUNDING_KEYS
    )


def grounding_table(results: list[dict[str, Any]], names: list[str]) -> str | None:
    """Accuracy on real images against the same model's accuracy with blank or shuffled images; None if no run
    is a control run."""
    rows = []
    for control, control_name in zip(results, names, strict=True):
        kind = control.get("metadata", {}).get("image_control", "none")
        if kind == "none":
            continue
        pairs = [(r, n) for r, n in zip(results, names, strict=True) if _matches(control["metadata"], r["metadata"])]
        if not pairs:
            rows.append([control_name, kind, NONE, NONE, _percent(control["summary"]["accuracy"]), NONE, NONE])
            continue
        real, real_name = pairs[0]
        test = mcnemar_exact(real["records"], control["records"])
        drop = _points(real["summary"]["accuracy"], control["summary"]["accuracy"])
        rows.append(
            [
                control_name,
                kind,
                real_name,
                _percent(real["summary"]["accuracy"]),
                _percent(control["summary"]["accuracy"]),
                drop,
                _p_value(test["p_value"]),
            ]
        )
    if not rows:
        return None
    header = ["Control run", "Images", "Real-image run", "Accuracy (real)", "Accuracy (control)", "Drop (pp)", "p"]
    return _markdown(header, rows)


def _natural(entry: str) -> tuple[int, int, str]:
    """Counts in numeric order (2 before 10), names alphabetically."""
    return (0, int(entry), "") if entry.isdigit() else (1, 0, entry)


def mapping_table(
    results: list[dict[str, Any]], names: list[str], key: str, label: str, show: Callable[[Any], str]
) -> str | None:
    """One row per entry of the summary's mapping `key` (e.g. accuracy per shape), one column per run."""
    mappings = [result["summary"].get(key) or {} for result in results]
    entries = sorted({entry for mapping in mappings for entry in mapping}, key=_natural)
    if not entries:
        return None
    rows = [[entry, *(show(mapping.get(entry)) for mapping in mappings)] for entry in entries]
    return _markdown([label, *names], rows)


def report(results: list[dict[str, Any]], names: list[str]) -> str:
    """Every section that applies to these results, as one markdown document (the first checks the items)."""
    sections = [("Evaluation comparison", comparison_table(results, names))]
    sections.append((f"Paired test against {names[0]}", significance_table(results, names)))
    sections.append(("Grounding check", grounding_table(results, names)))
    sections.append(("Accuracy by shape", mapping_table(results, names, "accuracy_by_shape", "shape", _percent)))
    sections.append(("Accuracy by true count", mapping_table(results, names, "accuracy_by_count", "count", _percent)))
    sections.append(("Mean reward parts", mapping_table(results, names, "rewards", "reward", _reward)))
    return "\n".join(f"## {title}\n\n{table}" for title, table in sections if table)


def plot_comparison(results: list[dict[str, Any]], names: list[str], path: str | Path) -> Figure:
    """Grouped bars of accuracy and format rate per run, read from the result files; saved as a PNG at `path`."""
    metrics = [("accuracy", "accuracy"), ("format_rate", "format rate")]
    width = 0.8 / len(metrics)
    figure = Figure(figsize=(max(4.5, 1.6 * len(results) + 1.5), 3.6))
    axis = figure.subplots()
    for offset, (key, label) in enumerate(metrics):
        heights = [100 * (result["summary"][key] or 0.0) for result in results]
        positions = [i + (offset - (len(metrics) - 1) / 2) * width for i in range(len(results))]
        bars = axis.bar(positions, heights, width, label=label)
        axis.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
    group_inches = (figure.get_figwidth() - 1.2) / len(results)  # the axes' width (margins aside) per run
    axis.set_xticks(range(len(results)), wrapped_names(names, int(group_inches * TICK_CHARS_PER_INCH)))
    axis.tick_params(axis="x", labelsize=TICK_FONT)
    axis.set_ylabel("% of items")
    axis.set_ylim(0, 125)  # room for the legend above a 100% bar
    axis.set_yticks(range(0, 101, 20))
    axis.set_title(f"n = {results[0]['summary']['n']} items", fontsize=10)
    axis.legend(loc="upper left", fontsize=8, frameon=False, ncol=len(metrics))
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return figure


def wrapped_names(names: list[str], width: int) -> list[str]:
    """Each name on lines of at most `width` characters, broken after `_`, `-` or `/` (within a piece longer than a
    line, anywhere; not after `.`, which would split `qwen2.5`): five names such as
    `geoqa_qwen2.5vl_lora_r16_step100_eval` side by side would otherwise run into each other under the bars, and
    the full names are in the report's tables."""
    width = max(width, 8)  # a piece is cut no shorter than this, however many runs share the figure
    wrapped = []
    for name in names:
        lines = [""]
        for piece in NAME_PIECES.findall(name):
            while piece:
                if lines[-1] and len(lines[-1]) + len(piece) > width:
                    lines.append("")
                room = width - len(lines[-1])
                lines[-1], piece = lines[-1] + piece[:room], piece[room:]
        wrapped.append("\n".join(lines))
    return wrapped


def default_names(paths: list[Path]) -> list[str]:
    """File stems (`base`, `step100`); whole paths when two stems coincide."""
    stems = [path.stem for path in paths]
    return stems if len(set(stems)) == len(stems) else [str(path) for path in paths]
