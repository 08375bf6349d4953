"""Reward plugins: every module in this folder (and in folders a recipe names in `reward_dirs`) registers named
reward functions with `@reward`, and a recipe picks them by name in `reward_funcs` with `reward_weights`.

Contract (TRL's): `f(completions, **columns) -> list[float | None]`, one value per completion. `completions` are
chat messages (`[{"role": "assistant", "content": str}]`) or strings; every dataset column (`answer`, `label`,
`shape`, `ground_truth`, ...) arrives as a keyword list aligned with them. A function may also declare
`eos_token_ids` to learn which completions were cut off at the length limit (their last id is not an EOS id).

Plugins are code: they run with your permissions. Only this folder and folders you name are ever imported.
"""

from vision_grpo.plugins.rewards import (
    BUILTIN_DIR,
    RegisteredReward,
    RewardFunc,
    RewardPluginError,
    completion_texts,
    discover,
    get_recipe_rewards,
    get_reward_funcs,
    reward,
    was_cut_off,
)

__all__ = [
    "BUILTIN_DIR",
    "RegisteredReward",
    "RewardFunc",
    "RewardPluginError",
    "completion_texts",
    "discover",
    "get_recipe_rewards",
    "get_reward_funcs",
    "reward",
    "was_cut_off",
]
