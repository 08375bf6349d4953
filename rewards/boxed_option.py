"""GeoQA's rewards: an option letter A-D in a `\\boxed{...}`, compared with the label (0-3 for A-D).

`boxed_option` is the GeoQA seed's rule exactly, so that our numbers on the fixed subset compare with the seed's
71% -> 87%: the answer is the last box that holds one letter, `re.findall(r"\\boxed\\s*\\{\\s*([A-D])\\s*\\}", text,
re.I)[-1]`. Boxes that hold anything else are skipped, so "... \\boxed{B} ... the angle is \\boxed{30°}" answers B.

`boxed_option_strict` is the stricter rule for those who want it: the last box is the answer, and it must hold one
letter. A final answer hedged over several letters (`\\boxed{A or B}`, `\\boxed{AB}`), an empty box or a box with
anything else earns nothing, even after an earlier one-letter box. The two agree whenever the last box holds one
letter. Under both, a bare letter outside a box earns nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from vision_grpo.rewards import completion_texts, reward

OPTION_LETTERS = "ABCD"
SEED_BOXED_OPTION = re.compile(r"\\boxed\s*\{\s*([A-D])\s*\}", re.IGNORECASE)  # the seed's pattern
BOX_OPENING = re.compile(r"\\boxed\s*\{")
ONE_LETTER = re.compile(r"\s*([A-Da-d])\s*\}")


def parse_boxed_option(text: str) -> str | None:
    """The seed's parser: the letter (upper case) of the last box holding one letter A-D, or None."""
    found = SEED_BOXED_OPTION.findall(text)
    return found[-1].upper() if found else None


def parse_boxed_option_strict(text: str) -> str | None:
    """The option letter (upper case) of the last `\\boxed{...}`, or None when that box is not one letter A-D."""
    openings = list(BOX_OPENING.finditer(text))
    if not openings:
        return None
    match = ONE_LETTER.match(text, openings[-1].end())
    return match.group(1).upper() if match else None


def _accuracy(parse: Callable[[str], str | None], completions, label: Sequence[int]) -> list[float]:
    return [
        1.0 if parse(text) == OPTION_LETTERS[int(gold)] else 0.0
        for text, gold in zip(completion_texts(completions), label, strict=True)
    ]


def _format(parse: Callable[[str], str | None], completions) -> list[float]:
    return [1.0 if parse(text) else 0.0 for text in completion_texts(completions)]


@reward()
def boxed_option(completions, label: Sequence[int], **kwargs) -> list[float]:
    """1.0 when the seed's parser reads the label's letter (the last one-letter box)."""
    return _accuracy(parse_boxed_option, completions, label)


@reward()
def boxed_option_format(completions, **kwargs) -> list[float]:
    """1.0 when the seed's parser finds an option; logged with weight 0 as the format rate."""
    return _format(parse_boxed_option, completions)


@reward()
def boxed_option_strict(completions, label: Sequence[int], **kwargs) -> list[float]:
    """1.0 when the last box holds exactly the label's letter."""
    return _accuracy(parse_boxed_option_strict, completions, label)


@reward()
def boxed_option_strict_format(completions, **kwargs) -> list[float]:
    """1.0 when the last box holds one option letter: the strict rule's format rate."""
    return _format(parse_boxed_option_strict, completions)
