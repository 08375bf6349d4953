"""The three-part counting reward in both flavours: the seed's keyword rules and the grounded default.

Rewards are called the way TRL calls them: chat-form completions plus every dataset column as a keyword list.
"""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vision_grpo.rewards.counting import (
    boxed_integer,
    count_boxed_correct,
    count_correct,
    count_description,
    count_format,
    count_reasoning,
    final_answer,
    last_integer,
    seed_count_correct,
    seed_count_description,
    seed_count_reasoning,
)

SEED = (seed_count_correct, seed_count_description, seed_count_reasoning)
GROUNDED = (count_correct, count_description, count_reasoning)
EVERY_REWARD = (*SEED, *GROUNDED, count_boxed_correct, count_format)
EOS = 2
COUNTS = {"triangles": 3, "circles": 2, "squares": 1}
IDEAL = "I see 3 triangles, 2 circles and 1 square, so the answer is 2."


def parts(
    funcs, text: str, shape: str = "circles", counts=None, completion_ids=None, eos_token_ids=None
) -> list[float]:
    """The score of each reward in `funcs` for one completion."""
    counts = COUNTS if counts is None else counts
    columns = {"answer": [counts[shape]], "shape": [shape], "ground_truth": [counts]}
    if eos_token_ids is not None:
        columns |= {"completion_ids": [completion_ids], "eos_token_ids": eos_token_ids}
    completions = [[{"role": "assistant", "content": text}]]
    return [func(completions, **columns)[0] for func in funcs]


@pytest.mark.parametrize("flavour", [SEED, GROUNDED], ids=["seed", "grounded"])
def test_the_seeds_ideal_answer_gets_full_marks(flavour) -> None:
    assert parts(flavour, IDEAL) == [1.0, 0.5, 0.2]


SPAM = [
    "1 red triangles, so red triangles, so red triangles, so green squares",
    "red triangles, so red triangles, so green squares, so blue circles",
]


@pytest.mark.parametrize("spam", SPAM)
@pytest.mark.parametrize("triangles", [2, 3, 4, 5])
def test_keyword_spam_scores_high_under_the_seed_rules_and_nothing_grounded(spam: str, triangles: int) -> None:
    counts = {"triangles": triangles, "circles": 2, "squares": 1}
    assert parts(SEED, spam, "triangles", counts) == [0.0, 0.5, 0.2]
    assert parts(GROUNDED, spam, "triangles", counts) == [0.0, 0.0, 0.0]


def test_keyword_spam_that_happens_to_be_right_gets_no_reasoning_credit() -> None:
    """With one triangle the spam's "1" is a correct answer and a true statement, but no reasoning leads to it."""
    counts = {"triangles": 1, "circles": 2, "squares": 1}
    assert parts(SEED, SPAM[0], "triangles", counts) == [1.0, 0.5, 0.2]
    assert parts(GROUNDED, SPAM[0], "triangles", counts) == [1.0, 0.5, 0.0]


def test_also_is_not_so() -> None:
    text = "I see 2 circles, also 2"
    assert parts(SEED, text)[2] == 0.0
    assert parts(GROUNDED, text)[2] == 0.0
    assert parts(GROUNDED, "I see 2 circles, so 2")[2] == 0.2


def test_a_false_statement_about_any_shape_voids_the_description() -> None:
    text = "I see 2 circles and 5 squares, so the answer is 2."
    assert parts(GROUNDED, text) == [1.0, 0.0, 0.0]
    assert parts(SEED, text) == [1.0, 0.5, 0.2]


def test_number_words_count_as_statements() -> None:
    assert parts(GROUNDED, "There are two circles, so the answer is 2.") == [1.0, 0.5, 0.2]


def test_cut_off_completions_earn_nothing_under_grounded_rules() -> None:
    cut_off = parts(GROUNDED, IDEAL, completion_ids=[5, 6, 7], eos_token_ids=[EOS])
    finished = parts(GROUNDED, IDEAL, completion_ids=[5, 6, EOS], eos_token_ids=[EOS])
    assert cut_off == [0.0, 0.0, 0.0]
    assert finished == [1.0, 0.5, 0.2]
    boxed = "I see 2 circles, so \\boxed{2}"
    assert parts((count_boxed_correct, count_format), boxed, completion_ids=[5], eos_token_ids=[EOS]) == [0.0, 0.0]
    assert parts((count_boxed_correct, count_format), boxed, completion_ids=[EOS], eos_token_ids=[EOS]) == [1.0, 1.0]


def test_boxed_answers_take_precedence_over_trailing_integers() -> None:
    assert parts((count_correct, count_boxed_correct, count_format), "\\boxed{2} (not 3)") == [1.0, 1.0, 1.0]
    assert parts((count_correct, count_boxed_correct, count_format), "2") == [1.0, 0.0, 0.0]
    assert parts((count_correct, count_boxed_correct), "\\boxed{two}, 2") == [0.0, 0.0]


def test_plain_string_completions_are_accepted() -> None:
    assert count_correct([IDEAL, "3"], answer=[2, 2]) == [1.0, 0.0]


HOSTILE = {
    "empty": "",
    "whitespace": " \n\t\r ",
    "100k letters": "x" * 100_000,
    "100k digits": "9" * 100_000,
    "100k number-shape pairs": "1 circles " * 10_000,
    "image pads": "<|image_pad|>" * 2_000,
    "unclosed boxes": "\\boxed{" * 10_000,
    "long number statement": "9" * 5_000 + " circles, so 2",
}
ZERO = {"empty", "whitespace", "100k letters", "image pads", "unclosed boxes"}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_completions_do_not_crash(name: str) -> None:
    start = time.perf_counter()
    scores = parts(EVERY_REWARD, HOSTILE[name])
    assert time.perf_counter() - start < 30.0  # a hang guard (a backtracking pattern takes minutes), not a speed figure
    assert all(isinstance(score, float) for score in scores)
    if name in ZERO:
        assert scores == [0.0] * len(EVERY_REWARD)
    assert parts(GROUNDED, HOSTILE[name]).count(0.5) == 0  # no grounded description in any of them


def test_an_image_pad_in_a_completion_is_only_text() -> None:
    assert parts(GROUNDED, "<|image_pad|> I see 2 circles, so <|image_pad|> 2") == [1.0, 0.5, 0.2]


NO_DIGITS = st.text().filter(lambda s: not re.search(r"\d", s))
NOT_ENDING_IN_DIGIT = st.text().filter(lambda s: not re.search(r"\d\Z", s))
NO_BOX = st.text().filter(lambda s: "\\boxed" not in s)
COUNT = st.integers(0, 10**12)


@settings(max_examples=200, deadline=None)
@given(prefix=NOT_ENDING_IN_DIGIT, value=COUNT, suffix=NO_DIGITS)
def test_last_integer_reads_the_last_digit_run(prefix: str, value: int, suffix: str) -> None:
    parsed = last_integer(prefix + str(value) + suffix)
    assert (parsed.value, parsed.start) == (value, len(prefix))


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_last_integer_is_none_exactly_without_digits(text: str) -> None:
    assert (last_integer(text) is None) == (re.search(r"\d", text) is None)


@settings(max_examples=200, deadline=None)
@given(prefix=st.text(), value=COUNT, spaces=st.sampled_from(["", " ", "  "]), suffix=NO_BOX)
def test_boxed_integer_reads_the_last_box(prefix: str, value: int, spaces: str, suffix: str) -> None:
    box = f"\\boxed{{{spaces}{value}{spaces}}}"
    parsed = boxed_integer(prefix + box + suffix)
    assert (parsed.value, parsed.start) == (value, len(prefix))


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("\\boxed{}0123456789 x"))))
def test_final_answer_prefers_the_box_and_never_crashes(text: str) -> None:
    expected = boxed_integer(text) if "\\boxed" in text else last_integer(text)
    assert final_answer(text) == expected
    for parser in (last_integer, boxed_integer, final_answer):
        parsed = parser(text)
        assert parsed is None or (parsed.value >= 0 and 0 <= parsed.start < len(text))
