"""GeoQA's reward (the GeoQA seed's): 1.0 when the last `\\boxed{...}` holds exactly one option letter equal to the
label, else 0.0. Only the last box counts, so a tentative option inside the reasoning is tolerated, but a final
answer hedged over several letters (`\\boxed{A or B}`, `\\boxed{AB}`), an empty box or a bare letter earns nothing.

One deliberate difference from the seed's parser: the seed takes the last box that *parses* (`findall(...)[-1]`),
so `\\boxed{A} ... \\boxed{A or B}` counted as A there; here the last box is the answer, and a hedged final box
earns nothing (the issue's rule). Both agree whenever the last box holds one letter.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vision_grpo.rewards import completion_texts, reward

OPTION_LETTERS = "ABCD"
BOX_OPENING = re.compile(r"\\boxed\s*\{")
ONE_LETTER = re.compile(r"\s*([A-Da-d])\s*\}")


def parse_boxed_option(text: str) -> str | None:
    """The option letter (upper case) of the last `\\boxed{...}`, or None when that box is not one letter A-D."""
    openings = list(BOX_OPENING.finditer(text))
    if not openings:
        return None
    match = ONE_LETTER.match(text, openings[-1].end())
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
