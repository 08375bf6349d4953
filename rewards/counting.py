"""The shape-counting seed's three-part reward (correct +1.0, describes +0.5, reasons +0.2), in two flavours.

`seed_count_*`: the seed's rules exactly. They are hackable: under GRPO a tiny model learned to emit one keyword
string for every image ("1 red triangles, so red triangles, so ...") and collected the description and reasoning
rewards while counting nothing.

`count_*` (grounded, the default): a description only counts when it states the asked shape's count and every
"<number> <shape>" it states is true for this image; reasoning only counts when a connective stands between that
description and the final answer; a completion cut off at the length limit earns nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from vision_grpo.rewards import completion_texts, reward, was_cut_off

NUMBER_WORDS = {
    w: i for i, w in enumerate(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"])
}
_NUMBER = r"\d+|" + "|".join(NUMBER_WORDS)
STATEMENT = re.compile(rf"\b({_NUMBER})\s+(?:(?:red|blue|green)\s+)?(triangle|circle|square)s?\b", re.IGNORECASE)
INTEGER = re.compile(r"\d+")
BOXED_INTEGER = re.compile(r"\\boxed\s*\{\s*(\d+)\s*\}")
CONNECTIVE = re.compile(r"\b(?:so|therefore|thus|hence|in total|total|the count is|the answer is)\b", re.IGNORECASE)
SEED_REASONING = re.compile(r"\b(?:therefore|so|total|the count is|the answer is)\b", re.IGNORECASE)
SEED_KEYWORDS = {
    "triangles": ("triangle", "red", "triangular"),
    "circles": ("circle", "blue", "circular"),
    "squares": ("square", "green", "rectangular"),
}


# Python refuses to parse integers of more than 4300 digits (and a count never has more than a few): longer digit
# runs read as TOO_LARGE, which equals no count, instead of crashing the reward on a runaway completion.
MAX_DIGITS = 18
TOO_LARGE = 10**MAX_DIGITS


@dataclass(frozen=True)
class FinalAnswer:
    value: int
    start: int


def _parse_digits(digits: str) -> int:
    significant = digits.lstrip("0")
    return int(significant or "0") if len(significant) <= MAX_DIGITS else TOO_LARGE


def last_integer(text: str) -> FinalAnswer | None:
    """The seed's parser: the last run of digits in the response."""
    last = None
    for last in INTEGER.finditer(text):  # noqa: B007 - the loop keeps the last match
        pass
    return FinalAnswer(_parse_digits(last.group()), last.start()) if last else None


def boxed_integer(text: str) -> FinalAnswer | None:
    """The integer in the last `\\boxed{...}`; None if the last box holds anything but an integer."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    match = BOXED_INTEGER.match(text, start)
    return FinalAnswer(_parse_digits(match.group(1)), match.start()) if match else None


def final_answer(text: str) -> FinalAnswer | None:
    """The grounded reading of the final answer: the last box if there is one, else the last integer."""
    return boxed_integer(text) if "\\boxed" in text else last_integer(text)


def _number(token: str) -> int:
    return _parse_digits(token) if token.isdigit() else NUMBER_WORDS[token.lower()]


def grounded_description_end(text: str, shape: str, counts: dict[str, int]) -> int | None:
    """End offset of the first statement about the asked shape if the description is grounded, else None.

    Grounded: at least one "<number> <shape>" statement about the asked shape, and every statement true.
    """
    first_about_asked = None
    for match in STATEMENT.finditer(text):
        stated_shape = match.group(2).lower() + "s"
        if _number(match.group(1)) != counts.get(stated_shape):
            return None
        if first_about_asked is None and stated_shape == shape:
            first_about_asked = match.end()
    return first_about_asked


def _mentions(text: str, shape: str) -> bool:
    lowered = text.lower()
    return any(keyword in lowered for keyword in SEED_KEYWORDS[shape])


# --- the seed's rules -------------------------------------------------------------------------------------------


@reward()
def seed_count_correct(completions, answer: Sequence[int], **kwargs) -> list[float]:
    """+1.0 when the last integer of the response equals the count (seed)."""
    results = []
    for text, gold in zip(completion_texts(completions), answer, strict=True):
        parsed = last_integer(text)
        results.append(1.0 if parsed and parsed.value == int(gold) else 0.0)
    return results


@reward()
def seed_count_description(completions, shape: Sequence[str], **kwargs) -> list[float]:
    """+0.5 when the response mentions the asked shape's word or colour (seed)."""
    return [0.5 if _mentions(text, s) else 0.0 for text, s in zip(completion_texts(completions), shape, strict=True)]


@reward()
def seed_count_reasoning(completions, **kwargs) -> list[float]:
    """+0.2 when the response holds a reasoning word, as a whole word (seed)."""
    return [0.2 if SEED_REASONING.search(text) else 0.0 for text in completion_texts(completions)]


# --- grounded rules (default) -----------------------------------------------------------------------------------


def _finished(completions, completion_ids, eos_token_ids) -> list[tuple[str, bool]]:
    ids = completion_ids if completion_ids is not None else [None] * len(completions)
    return [
        (text, not was_cut_off(i, eos_token_ids)) for text, i in zip(completion_texts(completions), ids, strict=True)
    ]


@reward()
def count_correct(completions, answer, completion_ids=None, eos_token_ids=None, **kwargs) -> list[float]:
    """+1.0 when the final answer (last box, else last integer) equals the count and the response finished."""
    return [
        1.0 if done and (parsed := final_answer(text)) and parsed.value == int(gold) else 0.0
        for (text, done), gold in zip(_finished(completions, completion_ids, eos_token_ids), answer, strict=True)
    ]


@reward()
def count_boxed_correct(completions, answer, completion_ids=None, eos_token_ids=None, **kwargs) -> list[float]:
    """+1.0 only when the last `\\boxed{N}` equals the count (strict format) and the response finished."""
    return [
        1.0 if done and (parsed := boxed_integer(text)) and parsed.value == int(gold) else 0.0
        for (text, done), gold in zip(_finished(completions, completion_ids, eos_token_ids), answer, strict=True)
    ]


@reward()
def count_format(completions, completion_ids=None, eos_token_ids=None, **kwargs) -> list[float]:
    """1.0 when the response finished with a parseable `\\boxed{N}`; logged with weight 0 as the format rate."""
    return [
        1.0 if done and boxed_integer(text) else 0.0
        for text, done in _finished(completions, completion_ids, eos_token_ids)
    ]


@reward()
def count_description(
    completions, shape, ground_truth, completion_ids=None, eos_token_ids=None, **kwargs
) -> list[float]:
    """+0.5 when the response states the asked shape's count and every count it states is true."""
    rows = zip(_finished(completions, completion_ids, eos_token_ids), shape, ground_truth, strict=True)
    return [
        0.5 if done and grounded_description_end(text, s, counts) is not None else 0.0
        for (text, done), s, counts in rows
    ]


@reward()
def count_reasoning(completions, shape, ground_truth, completion_ids=None, eos_token_ids=None, **kwargs) -> list[float]:
    """+0.2 when a connective ("so", "therefore", ...) stands between a grounded description and the final answer."""
    results = []
    rows = zip(_finished(completions, completion_ids, eos_token_ids), shape, ground_truth, strict=True)
    for (text, done), s, counts in rows:
        end = grounded_description_end(text, s, counts) if done else None
        answer = final_answer(text) if end is not None else None
        bridged = answer is not None and answer.start >= end and CONNECTIVE.search(text, end, answer.start)
        results.append(0.2 if bridged else 0.0)
    return results
