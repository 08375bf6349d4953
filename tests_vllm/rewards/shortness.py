"""A reward that differs between completions of one prompt even for a random-weight model (the recipe's rewards
are all zero there): the advantages, the gradient and so the weights the engine must receive are non-zero."""

from vision_grpo.rewards import completion_texts, reward


@reward()
def shortness(completions, **kwargs) -> list[float]:
    return [-len(text) / 100 for text in completion_texts(completions)]
