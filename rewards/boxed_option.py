"""GeoQA's reward (the GeoQA seed's): 1.0 when the last `\\boxed{...}` holds exactly one option letter equal to the
label, else 0.0. Only the last box counts, so a tentative option inside the reasoning is tolerated, but a final
answer hedged over several letters (`\\boxed{A or B}`, `\\boxed{AB}`), an empty box or a bare letter earns nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vision_grpo.rewards import completion_texts, reward

OPTION_LETTERS = "ABCD"
BOXED_OPTION = re.compile(r"\\boxed\s*\{\s*([A-Da-d])\s*\}")


def parse_boxed_option(text: str) -> str | None:
    """The option letter (upper case) of the last `\\boxed{...}`, or None when that box is not one letter A-D."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    match = BOXED_OPTION.match(text, start)
    return match.group(1).upper() if match else None


@reward()
def boxed_option(completions, label: Sequence[int], **kwargs) -> list[float]:
    """1.0 when the last boxed option equals the label (0-3 for A-D)."""
    return [
        1.0 if parse_boxed_option(text) == OPTION_LETTERS[int(gold)] else 0.0
        for text, gold in zip(completion_texts(completions), label, strict=True)
    ]


@reward()
def boxed_option_format(completions, **kwargs) -> list[float]:
    """1.0 when the response ends with a parseable boxed option; logged with weight 0 as the format rate."""
    return [1.0 if parse_boxed_option(text) else 0.0 for text in completion_texts(completions)]
