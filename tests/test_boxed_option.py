"""The GeoQA reward: the last `\\boxed{...}` must hold exactly one option letter equal to the label."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vision_grpo.rewards import get_reward_funcs
from vision_grpo.rewards.boxed_option import boxed_option, boxed_option_format, parse_boxed_option

LETTERS = "ABCDabcd"
# Spaces the parser must accept inside the braces, Unicode ones included (the model writes Chinese text).
spaces = st.text(alphabet=" \t\n\u3000", max_size=3)
# Free text that cannot open a box of its own.
plain_text = st.text(max_size=60).filter(lambda text: "\\boxed" not in text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("所以答案是 \\boxed{A}。", "A"),
        ("\\boxed{ c }", "C"),
        ("\\boxed {b}", "B"),
        ("先猜 \\boxed{A}，再算一遍，最终 \\boxed{D}", "D"),
        ("\\boxed{A} was written \\boxed without braces", "A"),
        ("\\boxed{A or B}", None),
        ("\\boxed{AB}", None),
        ("\\boxed{}", None),
        ("\\boxed{E}", None),
        ("\\boxed{A", None),
        ("\\boxed{\\text{A}}", None),
        ("\\boxed{A} then \\boxed{A or B}", None),
        ("The answer is A", None),
        ("A", None),
        ("", None),
    ],
)
def test_parser_examples(text: str, expected: str | None) -> None:
    assert parse_boxed_option(text) == expected


def test_reward_requires_the_last_box_to_match() -> None:
    completions = [
        [{"role": "assistant", "content": "\\boxed{A}"}],
        [{"role": "assistant", "content": "\\boxed{A} 不对，应为 \\boxed{C}"}],
        [{"role": "assistant", "content": "A"}],
        [{"role": "assistant", "content": "\\boxed{A or B}"}],
        [{"role": "assistant", "content": "\\boxed{AB}"}],
        [{"role": "assistant", "content": "\\boxed{}"}],
        [{"role": "assistant", "content": "\\boxed{ b }"}],
    ]
    labels = [0, 0, 0, 0, 0, 0, 1]
    assert boxed_option(completions, label=labels) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert boxed_option_format(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_rewards_are_registered_under_their_names() -> None:
    accuracy, fmt = get_reward_funcs(["boxed_option", "boxed_option_format"])
    assert accuracy.__name__ == "boxed_option" and fmt.__name__ == "boxed_option_format"
    assert accuracy(["\\boxed{D}", "\\boxed{D}"], label=[3, 2]) == [1.0, 0.0]


@given(prefix=st.text(max_size=60), left=spaces, letter=st.sampled_from(LETTERS), right=spaces, suffix=plain_text)
@example(prefix="\\boxed{B}", left="", letter="a", right="", suffix="")
def test_last_single_letter_box_is_the_answer(prefix: str, left: str, letter: str, right: str, suffix: str) -> None:
    """Whatever comes before (even other boxes), a final one-letter box decides the answer."""
    text = f"{prefix}\\boxed{{{left}{letter}{right}}}{suffix}"
    assert parse_boxed_option(text) == letter.upper()


@given(
    prefix=st.text(max_size=60),
    content=st.text(max_size=8).filter(lambda c: "}" not in c and "\\boxed" not in c),
    suffix=plain_text,
)
@example(prefix="\\boxed{A}", content="A or B", suffix="")
@example(prefix="", content="AB", suffix="")
@example(prefix="", content="", suffix=" A")
def test_final_box_parses_only_as_one_letter(prefix: str, content: str, suffix: str) -> None:
    """The last box's content, stripped of white space, must be exactly one of A-D (any case); else no answer."""
    stripped = content.strip()
    expected = stripped.upper() if len(stripped) == 1 and stripped in LETTERS else None
    text = f"{prefix}\\boxed{{{content}}}{suffix}"
    assert parse_boxed_option(text) == expected


@given(text=plain_text)
def test_no_box_means_no_answer(text: str) -> None:
    assert parse_boxed_option(text) is None


boxed_text = st.builds(lambda text, content: f"{text}\\boxed{{{content}}}", plain_text, st.text(max_size=3))


@given(texts=st.lists(st.one_of(plain_text, boxed_text)), data=st.data())
def test_accuracy_never_exceeds_format(texts: list[str], data: st.DataObject) -> None:
    """Reward 1 implies a parseable final box, so per completion accuracy <= format (the two logged curves)."""
    labels = data.draw(st.lists(st.integers(0, 3), min_size=len(texts), max_size=len(texts)))
    accuracy = boxed_option(texts, label=labels)
    fmt = boxed_option_format(texts)
    assert all(a <= f for a, f in zip(accuracy, fmt, strict=True))
    assert all(value in (0.0, 1.0) for value in accuracy + fmt)
