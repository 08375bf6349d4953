"""Rewards of the generic VQA task (data/task_vqa.py): is the completion's final answer the row's answer, checked by
the row's `answer_type`:

- `choice`: the seed's boxed option rule (the last box holding one option letter, `\\boxed{B}`) with the row's own
  letters (A-D for four options, A-J for ten), against the letter of the right choice;
- `math`: mathematical equivalence through Hugging Face's `math_verify` (`\\boxed{\\sqrt{12}}` = `2\\sqrt{3}`);
- `number`: the last `\\boxed{...}` read as a number by `read_number`, within the row's `tolerance` (absolute);
- `exact`: the last `\\boxed{...}` equal to the answer once both are in `exact_form`, case ignored.

The task's checking pass stores each gold answer through the same `read_number` / `exact_form`, and the evaluator
scores with these functions: what the check accepts, the reward and the reported accuracy read the same way.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence

from math_verify import parse, verify

from vision_grpo.rewards import completion_texts, reward

ANSWER_TYPES = ("choice", "math", "number", "exact")
BOXED = re.compile(r"\\boxed\s*\{")
LETTERS = "ABCDEFGHIJ"  # the most options a choice row may have
BOXED_LETTER = re.compile(r"\\boxed\s*\{\s*([A-J])\s*\}", re.IGNORECASE)


# What a `number` answer may hold around its digits (docs/datasets.md, "Number answers"): minus signs other than
# ASCII's, LaTeX's `{,}` thousands separator, and one trailing unit: `%`, `\\%`, a word or `\\text{...}`.
MINUS_SIGNS = str.maketrans(dict.fromkeys("\u2212\u2012\u2013\ufe63\uff0d", "-"))
UNIT = re.compile(r"\s*(?:\\?%|\\(?:text|mathrm)\s*\{[^{}]*\}|[^\W\d_][^\W\d]*\.?)$")
PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def read_number(text: str) -> str:
    """The number `text` holds, as plain text (`-1234.5`), or ValueError saying why it holds none.

    One rule for gold answers (the checking pass stores what this returns, refusing the row on ValueError) and for
    completions (a box this refuses scores 0): Unicode forms folded (NFKC: full-width digits), any minus sign read as
    `-`, one trailing unit dropped (`30%`, `12 cm`, `5\\text{ apples}` read 30, 12, 5), commas read as thousands
    separators only between groups of three digits (`1,234,567`). Any other comma (`3,5`: a decimal comma, or a
    list?) is ambiguous and refused, as are infinities and NaN."""
    plain = unicodedata.normalize("NFKC", text).translate(MINUS_SIGNS).replace("{,}", ",").strip()
    plain = UNIT.sub("", plain).strip()
    if "," in plain:
        if not THOUSANDS.fullmatch(plain):
            raise ValueError("holds a comma that is not a thousands separator (1,234): write decimals with a point")
        plain = plain.replace(",", "")
    if not PLAIN_NUMBER.fullmatch(plain):
        raise ValueError("is not a number")
    if not math.isfinite(float(plain)):
        raise ValueError("is not finite")
    return plain


def exact_form(text: str) -> str:
    """`text` as `exact` answers compare it (case aside): Unicode forms folded (NFKC), every run of white space one
    space, none around; the checking pass stores gold answers in this form."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def choice_letter(text: str, options: int) -> str | None:
    """The letter (upper case) of the last box holding one of the row's `options` letters, or None: GeoQA's rule
    (rewards/boxed_option.py) over A-D when there are four options, over A-J when there are ten."""
    found = [letter.upper() for letter in BOXED_LETTER.findall(text) if letter.upper() in LETTERS[:options]]
    return found[-1] if found else None


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


def predicted(text: str, answer_type: str, options: int = len(LETTERS)) -> str | None:
    """The completion's final answer as the answer type reads it (`options`: a choice row's number of options);
    None when there is none to read."""
    if answer_type == "choice":
        return choice_letter(text, options)
    if answer_type == "math":
        found = _math_answer(text)
        return str(found[-1]) if found else None
    return last_boxed(text)


def is_correct(text: str, answer: str, answer_type: str, tolerance: float = 0.0, options: int = len(LETTERS)) -> bool:
    """Whether the completion's final answer equals `answer` under `answer_type`."""
    if answer_type == "choice":
        return choice_letter(text, options) == answer
    if answer_type == "math":
        found = _math_answer(text)
        return bool(found) and verify(as_math(answer), found)
    boxed = last_boxed(text)
    if boxed is None:
        return False
    if answer_type == "number":
        try:
            return abs(float(read_number(boxed)) - float(read_number(answer))) <= tolerance
        except ValueError:
            return False
    return exact_form(boxed).casefold() == exact_form(answer).casefold()


def _options(options: Sequence[int] | None, rows: int) -> Sequence[int]:
    return options if options is not None else [len(LETTERS)] * rows


@reward()
def vqa_answer(
    completions,
    answer: Sequence[str],
    answer_type: Sequence[str],
    tolerance: Sequence[float],
    options: Sequence[int] | None = None,
    **kwargs,
) -> list[float]:
    """1.0 when the final answer is right under the row's answer type (and number of options), else 0.0."""
    texts = completion_texts(completions)
    rows = zip(texts, answer, answer_type, tolerance, _options(options, len(texts)), strict=True)
    return [1.0 if is_correct(text, str(gold), kind, tol, n) else 0.0 for text, gold, kind, tol, n in rows]


@reward()
def vqa_format(completions, answer_type: Sequence[str], options: Sequence[int] | None = None, **kwargs) -> list[float]:
    """1.0 when the completion ends with an answer its answer type can read; logged with weight 0 as format rate."""
    texts = completion_texts(completions)
    rows = zip(texts, answer_type, _options(options, len(texts)), strict=True)
    return [1.0 if predicted(text, kind, n) is not None else 0.0 for text, kind, n in rows]
