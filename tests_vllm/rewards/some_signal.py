"""A reward with signal for about a quarter of the prompts only (by the prompt's id): the others' groups score alike,
so dynamic sampling has groups to replace in almost every step even for a random-weight model."""

import zlib

from vision_grpo.rewards import completion_texts, reward


@reward()
def some_signal(completions, **kwargs) -> list[float]:
    texts, ids = completion_texts(completions), kwargs["id"]
    return [-len(t) / 100 if zlib.crc32(str(i).encode()) % 4 == 0 else 0.3 for t, i in zip(texts, ids, strict=True)]
