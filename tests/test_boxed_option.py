"""The GeoQA rewards: the seed's parser (the last box that holds one option letter) and the strict one (the last box
must hold one option letter), each equal to the label."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vision_grpo.rewards import get_reward_funcs
from vision_grpo.rewards.boxed_option import (
    boxed_option,
    boxed_option_format,
    boxed_option_strict,
    boxed_option_strict_format,
    parse_boxed_option,
    parse_boxed_option_strict,
)

LETTERS = "ABCDabcd"
# Spaces the parser must accept inside the braces, Unicode ones included (the model writes Chinese text).
spaces = st.text(alphabet=" \t\n\u3000", max_size=3)
# Free text that cannot open a box of its own.
plain_text = st.text(max_size=60).filter(lambda text: "\\boxed" not in text)


# (text, seed's parser, strict parser)
EXAMPLES = [
    ("所以答案是 \\boxed{A}。", "A", "A"),
    ("\\boxed{ c }", "C", "C"),
    ("\\boxed {b}", "B", "B"),
    ("先猜 \\boxed{A}，再算一遍，最终 \\boxed{D}", "D", "D"),
    ("\\boxed{A} was written \\boxed without braces", "A", "A"),
    ("\\boxed{B} ... so the angle is \\boxed{30°}", "B", None),  # the example: B for the seed
    ("\\boxed{A} then \\boxed{A or B}", "A", None),
    ("\\boxed{A or B}", None, None),
    ("\\boxed{AB}", None, None),
    ("\\boxed{}", None, None),
    ("\\boxed{E}", None, None),
    ("\\boxed{A", None, None),
    ("\\boxed{\\text{A}}", None, None),
    ("The answer is A", None, None),
    ("A", None, None),
    ("", None, None),
]


@pytest.mark.parametrize(("text", "seed", "strict"), EXAMPLES)
def test_parser_examples(text: str, seed: str | None, strict: str | None) -> None:
    assert parse_boxed_option(text) == seed
    assert parse_boxed_option_strict(text) == strict


@given(text=st.text(alphabet=st.sampled_from(list("\\boxed{} ABCDEabcd30°x\n")), max_size=40) | st.text(max_size=40))
@example(text="\\boxed{B} ... \\boxed{30°}")
def test_the_seed_parser_is_the_seeds_findall(text: str) -> None:
    """Character for character the seed's expression (its letter upper-cased), on arbitrary text."""
    found = re.findall(r"\\boxed\s*\{\s*([A-D])\s*\}", text, re.I)
    assert parse_boxed_option(text) == (found[-1].upper() if found else None)


def test_seed_reward_takes_the_last_box_that_parses() -> None:
    completions = [
        [{"role": "assistant", "content": "\\boxed{A}"}],
        [{"role": "assistant", "content": "\\boxed{A} 不对，应为 \\boxed{C}"}],
        [{"role": "assistant", "content": "A"}],
        [{"role": "assistant", "content": "\\boxed{A} then \\boxed{30°}"}],
        [{"role": "assistant", "content": "\\boxed{AB}"}],
        [{"role": "assistant", "content": "\\boxed{}"}],
        [{"role": "assistant", "content": "\\boxed{ b }"}],
    ]
    labels = [0, 0, 0, 0, 0, 0, 1]
    assert boxed_option(completions, label=labels) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert boxed_option_format(completions) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_reward_requires_the_last_box_to_match() -> None:
    completions = [
        [{"role": "assistant", "content": "\\boxed{A}"}],
        [{"role": "assistant", "content": "\\boxed{A} 不对，应为 \\boxed{C}"}],
        [{"role": "assistant", "content": "A"}],
        [{"role": "assistant", "content": "\\boxed{A or B}"}],
        [{"role": "assistant", "content": "\\boxed{A} then \\boxed{30°}"}],
        [{"role": "assistant", "content": "\\boxed{}"}],
        [{"role": "assistant", "content": "\\boxed{ b }"}],
    ]
    labels = [0, 0, 0, 0, 0, 0, 1]
    assert boxed_option_strict(completions, label=labels) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert boxed_option_strict_format(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_rewards_are_registered_under_their_names() -> None:
    names = ["boxed_option", "boxed_option_format", "boxed_option_strict", "boxed_option_strict_format"]
    funcs = get_reward_funcs(names)
    assert [func.__name__ for func in funcs] == names
    texts = ["\\boxed{D} \\boxed{x}", "\\boxed{D}"]
    assert [func(texts, label=[3, 2]) for func in funcs] == [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]


@given(prefix=st.text(max_size=60), left=spaces, letter=st.sampled_from(LETTERS), right=spaces, suffix=plain_text)
@example(prefix="\\boxed{B}", left="", letter="a", right="", suffix="")
def test_last_single_letter_box_is_the_answer(prefix: str, left: str, letter: str, right: str, suffix: str) -> None:
    """Whatever comes before (even other boxes), a final one-letter box decides the answer."""
    text = f"{prefix}\\boxed{{{left}{letter}{right}}}{suffix}"
    assert parse_boxed_option(text) == parse_boxed_option_strict(text) == letter.upper()


@given(
    prefix=st.text(max_size=60),
    content=st.text(max_size=8).filter(lambda c: "}" not in c and "\\boxed" not in c),
    suffix=plain_text,
)
@example(prefix="\\boxed{A}", content="A or B", suffix="")
@example(prefix="", content="AB", suffix="")
@example(prefix="", content="", suffix=" A")
def test_final_box_parses_only_as_one_letter(prefix: str, content: str, suffix: str) -> None:
    """Strict: the last box's content, stripped of white space, must be exactly one of A-D (any case)."""
    stripped = content.strip()
    expected = stripped.upper() if len(stripped) == 1 and stripped in LETTERS else None
    text = f"{prefix}\\boxed{{{content}}}{suffix}"
    assert parse_boxed_option_strict(text) == expected


@given(text=plain_text)
def test_no_box_means_no_answer(text: str) -> None:
    assert parse_boxed_option(text) is None and parse_boxed_option_strict(text) is None


boxed_text = st.builds(lambda text, content: f"{text}\\boxed{{{content}}}", plain_text, st.text(max_size=3))


@given(texts=st.lists(st.one_of(plain_text, boxed_text)), data=st.data())
def test_accuracy_never_exceeds_format(texts: list[str], data: st.DataObject) -> None:
    """Reward 1 implies a parsed option, so per completion accuracy <= format (the two logged curves), under both
    rules; and the strict rule never rewards what the seed's does not."""
    labels = data.draw(st.lists(st.integers(0, 3), min_size=len(texts), max_size=len(texts)))
    seed, strict = boxed_option(texts, label=labels), boxed_option_strict(texts, label=labels)
    for accuracy, fmt in ((seed, boxed_option_format(texts)), (strict, boxed_option_strict_format(texts))):
        assert all(a <= f for a, f in zip(accuracy, fmt, strict=True))
        assert all(value in (0.0, 1.0) for value in accuracy + fmt)
    assert all(b <= a for a, b in zip(seed, strict, strict=True))
