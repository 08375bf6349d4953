"""One experiment's table, McNemar's tests and headline facts, every figure read from the result files' records."""

from __future__ import annotations

from typing import Any

from vision_grpo.demo.experiments import PASS_K, Experiment
from vision_grpo.demo.stages import Evaluated
from vision_grpo.evaluation.statistics import mcnemar_exact


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _distinct(summary: dict[str, Any]) -> str:
    return str(round(summary["distinct_output_rate"] * summary["n"]))


def _count_row(count: str, model: Evaluated) -> str:
    greedy = model.greedy["summary"]["accuracy_by_count"].get(count)
    sampled = model.sampled["summary"]
    pass_1, pass_k = sampled["pass_at_1_by_count"].get(count), sampled["pass_at_k_by_count"].get(count)
    return f"{_pct(greedy)} · {_pct(pass_1)} · {_pct(pass_k)}"


def _rows(models: list[Evaluated], passes: str) -> list[tuple[str, list[str]]]:
    """The table's rows: name and one cell per model, all read from the result files; `passes` says how the
    token-passes were counted."""
    greedy = [m.greedy["summary"] for m in models]
    sampled = [m.sampled["summary"] for m in models]
    blank = [m.blank["summary"] for m in models]
    shuffled = [m.shuffled["summary"] for m in models]
    first = models[0].greedy
    temperature = models[0].sampled["metadata"]["decoding"]["temperature"]
    counts = sorted({r["gold"] for r in first["records"]}, key=int)
    sizes = {c: sum(1 for r in first["records"] if r["gold"] == c) for c in counts}
    rows = [
        ("held-out images (n)", [str(s["n"]) for s in greedy]),
        ("accuracy (strict: last \\boxed{N} right)", [_pct(s["accuracy"]) for s in greedy]),
        *[
            (f"{c}-shape images (n = {sizes[c]}): greedy · pass@1 · pass@{PASS_K}", [_count_row(c, m) for m in models])
            for c in counts
        ],
        ("lenient accuracy (final number right)", [_pct(s["lenient_accuracy"]) for s in greedy]),
        ("format rate (ends with \\boxed{N})", [_pct(s["format_rate"]) for s in greedy]),
        ("accuracy among formatted", [_pct(s["conditional_accuracy"]) for s in greedy]),
        *[(f"reward part `{k}`", [f"{s['rewards'][k]:.3f}" for s in greedy]) for k in greedy[0]["rewards"]],
        (f"pass@1 (one sample at temperature {temperature:g})", [_pct(s["pass_at_1"]) for s in sampled]),
        (f"pass@{PASS_K} (some of {PASS_K} samples right)", [_pct(s["pass_at_k"]) for s in sampled]),
        (f"training after the warm start (token-passes: {passes})", [m.training for m in models]),
        ("-- honesty checks --", ["" for _ in models]),
        ("distinct greedy outputs across the images", [_distinct(s) for s in greedy]),
        ("strict accuracy with a blank image", [_pct(s["accuracy"]) for s in blank]),
        ("lenient accuracy with a blank image", [_pct(s["lenient_accuracy"]) for s in blank]),
        ("strict accuracy with shuffled images (another image's)", [_pct(s["accuracy"]) for s in shuffled]),
        ("completions cut off at the length limit", [_pct(s["hit_limit_rate"]) for s in greedy]),
        (f"samples cut off at the length limit (pass@{PASS_K})", [_pct(s["hit_limit_rate"]) for s in sampled]),
    ]
    return rows


def _mcnemar(first: Evaluated, second: Evaluated) -> tuple[str, float]:
    test = mcnemar_exact(first.greedy["records"], second.greedy["records"])
    line = (
        f"McNemar exact test on strict accuracy, {first.label} → {second.label}: {test['b']} images right only with "
        f"'{first.label}', {test['c']} only with '{second.label}', p = {test['p_value']:.3g}."
    )
    return line, test["p_value"]


def report(experiment: Experiment, models: list[Evaluated]) -> tuple[str, dict[str, Any]]:
    """One experiment's table, McNemar's tests and headline facts, computed from the result files' records."""
    lines = [f"## {experiment.title}", "", "| | " + " | ".join(m.label for m in models) + " |"]
    lines.append("|---" * (len(models) + 1) + "|")
    passes = "generated tokens + 3 x positions trained" if experiment.variant else "GRPO 4, SFT 3 per token"
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in _rows(models, passes)]
    warm, grpo, *control = models
    pairs = [(warm, grpo)]
    if control:  # GRPO against the control, and whether the control moved off its warm start at all
        pairs += [(control[0], grpo), (warm, control[0])]
    tests = [_mcnemar(first, second) for first, second in pairs]
    lines += ["", *(line for line, _ in tests)]
    accuracy = {m.label: m.greedy["summary"]["accuracy"] for m in models}
    facts: dict[str, Any] = {
        "p_value": tests[0][1],
        "accuracy_gain": accuracy[grpo.label] - accuracy[warm.label],
        "blank_gap_after": accuracy[grpo.label] - grpo.blank["summary"]["accuracy"],
        "cut_off_after": grpo.greedy["summary"]["hit_limit_rate"],
    }
    if control:
        facts["p_value_vs_control"] = tests[1][1]
        facts["gain_vs_control"] = accuracy[grpo.label] - accuracy[control[0].label]
    return "\n".join(lines), facts
