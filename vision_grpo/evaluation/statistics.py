"""Paired significance of two evaluations of the same items: McNemar's exact test on the items only one of them got
right (the compare tables and the demo's report both read it from here).
"""

from __future__ import annotations

from typing import Any

from scipy.stats import binomtest


class ResultError(ValueError):
    """Result files that cannot be compared: unreadable, not evaluation results, or of different items."""


class ItemMismatch(ResultError):
    """Result files that do not hold the same items, so their accuracies cannot be compared pairwise."""


def exact_binomial_p(b: int, c: int) -> float:
    """Two-sided exact p-value of `b` vs `c` under Binomial(b + c, 1/2): McNemar's exact test, by scipy's `binomtest`
    (no discordant item: nothing to test, p = 1)."""
    if b + c == 0:
        return 1.0
    return float(binomtest(b, b + c, 0.5).pvalue)


def mcnemar_exact(records_a: list[dict[str, Any]], records_b: list[dict[str, Any]]) -> dict[str, Any]:
    """Paired accuracy test of two runs over the same items.

    `b`: items only run A got right; `c`: items only run B got right; `p_value`: exact two-sided test that A and B
    are equally accurate. Items both got right or both got wrong carry no information about the difference.
    """
    a = {r["id"]: bool(r["correct"]) for r in records_a}
    b = {r["id"]: bool(r["correct"]) for r in records_b}
    if a.keys() != b.keys() or len(a) != len(records_a) or len(b) != len(records_b):
        raise ItemMismatch("McNemar's test needs the same items, each once, in both runs")
    only_a = sum(1 for i in a if a[i] and not b[i])
    only_b = sum(1 for i in a if b[i] and not a[i])
    return {"b": only_a, "c": only_b, "p_value": exact_binomial_p(only_a, only_b)}
