"""Test-only reward plugin: a reward that varies between completions, plus a record of the prompts scored.

A random-weight model never earns the task rewards, so every advantage is zero and nothing moves. Rewarding the
number of distinct characters gives different completions of one prompt different rewards, hence a real gradient.
Recording the `id` column shows which prompts each process generated for.
"""

from __future__ import annotations

from recorder import record

from vision_grpo.rewards import completion_texts, reward


@reward()
def distinct_characters(completions, **kwargs) -> list[float]:
    """0.1 per distinct character of the completion."""
    record("rewarded", ids=list(kwargs["id"]))
    return [len(set(text)) / 10 for text in completion_texts(completions)]
