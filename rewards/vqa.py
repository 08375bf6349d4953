"""Rewards of the generic VQA task (data/task_vqa.py): is the completion's final answer the row's answer, checked by
the row's `answer_type`:

- `choice`: the seed's boxed option letter (`\\boxed{B}`), against the letter of the right choice;
- `math`: mathematical equivalence through Hugging Face's `math_verify` (`\\boxed{\\sqrt{12}}` = `2\\sqrt{3}`);
- `number`: the last `\\boxed{...}` read as a number, within the row's `tolerance` (absolute);
- `exact`: the last `\\boxed{...}`, case and surrounding spaces ignored, equal to the answer.

The evaluator scores with the same functions, so the training reward and the reported accuracy are one rule.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from math_verify import parse, verify

from vision_grpo.rewards import completion_texts, reward
from vision_grpo.rewards.boxed_option import parse_boxed_option

ANSWER_TYPES = ("choice", "math", "number", "exact")
BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced (math answers hold braces: `\\frac{1}{2}`)."""
    openings = list(BOXED.finditer(text))
    if not openings:
        return None
    depth, start = 1, openings[-1].end()
    for position in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[start:position].strip()
    return None  # an unclosed box (cut off at the length limit)


def as_math(answer: str) -> list:
    """`math_verify`'s reading of a gold answer, delimited as LaTeX so that `2\\sqrt{3}` is not read as `2`."""
    return parse(answer if answer.strip().startswith("$") else f"${answer}$")


# `math_verify` reads the end of a completion only: on a 100k-character ramble it took seconds per call.
MATH_TAIL = 400


def _math_answer(text: str) -> list:
    """`math_verify`'s reading of the completion's final answer: its last box, else the end of the text."""
    boxed = last_boxed(text)
    return as_math(boxed[-MATH_TAIL:]) if boxed is not None else parse(text[-MATH_TAIL:])


def predicted(text: str, answer_type: str) -> str | None:
    """The completion's final answer as the answer type reads it; None when there is none to read."""
    if answer_type == "choice":
        return parse_boxed_option(text)
    if answer_type == "math":
        found = _math_answer(text)
        return str(found[-1]) if found else None
    return last_boxed(text)


def is_correct(text: str, answer: str, answer_type: str, tolerance: float = 0.0) -> bool:
    """Whether the completion's final answer equals `answer` under `answer_type`."""
    if answer_type == "choice":
        return parse_boxed_option(text) == answer
    if answer_type == "math":
        found = _math_answer(text)
        return bool(found) and verify(as_math(answer), found)
    boxed = last_boxed(text)
    if boxed is None:
        return False
    if answer_type == "number":
        try:
            return abs(float(boxed.replace(",", "")) - float(answer)) <= tolerance
        except ValueError:
            return False
    return boxed.casefold() == answer.strip().casefold()


@reward()
def vqa_answer(
    completions, answer: Sequence[str], answer_type: Sequence[str], tolerance: Sequence[float], **kwargs
) -> list[float]:
    """1.0 when the final answer is right under the row's answer type, else 0.0."""
    return [
        1.0 if is_correct(text, str(gold), kind, tol) else 0.0
        for text, gold, kind, tol in zip(completion_texts(completions), answer, answer_type, tolerance, strict=True)
    ]


@reward()
def vqa_format(completions, answer_type: Sequence[str], **kwargs) -> list[float]:
    """1.0 when the completion ends with an answer its answer type can read; logged with weight 0 as format rate."""
    return [
        1.0 if predicted(text, kind) is not None else 0.0
        for text, kind in zip(completion_texts(completions), answer_type, strict=True)
    ]
