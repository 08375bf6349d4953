"""The summary of an evaluation, a pure function of its per-example records (each task scores its examples: the
`score` of its module in data/), so anyone can recompute every number in a result file from its `records` (a
test does).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _rate(records: list[dict[str, Any]], key: str) -> float | None:
    return _mean([1.0 if r[key] else 0.0 for r in records])


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy, format rate, conditional accuracy, truncation, lengths, distinct outputs, and task breakdowns."""
    formatted = [r for r in records if r["prediction"] is not None]
    unparsed = [r for r in records if r["prediction"] is None]
    summary: dict[str, Any] = {
        "n": len(records),
        "accuracy": _rate(records, "correct"),
        "format_rate": _mean([1.0 if r["prediction"] is not None else 0.0 for r in records]),
        "conditional_accuracy": _rate(formatted, "correct"),
        "unparsed": len(unparsed),
        "unparsed_hit_limit": sum(1 for r in unparsed if r["hit_limit"]),
        "hit_limit_rate": _rate(records, "hit_limit"),
        "mean_completion_tokens": _mean([r["completion_tokens"] for r in records]),
        "mean_completion_tokens_formatted": _mean([r["completion_tokens"] for r in formatted]),
        "distinct_output_rate": len({r["text"] for r in records}) / len(records) if records else None,
    }
    if records and "lenient_correct" in records[0]:
        summary["lenient_accuracy"] = _rate(records, "lenient_correct")
        for key in ("shape", "gold"):
            groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for r in records:
                groups[str(r[key])].append(r)
            name = "accuracy_by_shape" if key == "shape" else "accuracy_by_count"
            summary[name] = {k: _rate(v, "correct") for k, v in sorted(groups.items())}
    reward_names = sorted({name for r in records for name in r.get("rewards", {})})
    summary["rewards"] = {
        name: _mean([r["rewards"][name] for r in records if r["rewards"].get(name) is not None])
        for name in reward_names
    }
    return summary
