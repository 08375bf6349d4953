"""The one table of numeric limits that recipe keys and the entry points' own size and count flags are checked
against, while the arguments are parsed: a value out of range would otherwise be refused by TRL or torch only once
the model has loaded, silently mean something else, or make a formula meaningless (a negative pixel count's square
root is complex; a trillion pixels is a billion-token prompt).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

# No image above this many pixels is decoded (data's MAX_DECODE_PIXELS; tests check the two agree), so a pixel limit
# above it means nothing.
PIXEL_CEILING = 64_000_000

# Trainer keys whose bad values TRL or torch refuse only once the model has loaded (a negative learning rate, when
# the optimizer is built; a batch of 0 or a temperature of 0 at the first step), that would generate nothing to
# learn from (no completion tokens), or that would silently mean something else (`max_steps: -5` trains by epochs,
# `token_check_samples: -5` checks every prompt as -1 does); the processor's pixel limits; the memory plan's flags;
# the seconds a rank may stall, a reward call may take or the process group and the vLLM server may wait; the steps
# in a row a reward may be down (0 would stop the run at a step that has every reward).
LOWER_BOUNDS = {
    "max_completion_length": 1,
    "learning_rate": 0,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "max_steps": -1,
    "min_pixels": 1,
    "max_pixels": 1,
    "num_processes": 1,
    "image_pixels": 1,
    "images_per_prompt": 1,
    "prompt_text_tokens": 0,
    "expected_completion_length": 1,
    "token_check_samples": -1,
    "rank_stall_timeout": 0,
    "reward_timeout": 0,
    "ddp_timeout": 1,
    "dynamic_sampling_rounds": 0,
    "reward_outage_steps": 1,
}
# Every key in seconds. A week is far above any wait these keys allow for (a reward asking a slow remote judge, a
# rank held up by a long checkpoint write, a large model's vLLM server starting), so no real setting is refused; a
# larger value is a run that may hang unseen for weeks, and a huge one fails only mid-run (a reward's time limit
# above threading.TIMEOUT_MAX, about 292 years, kills the thread that enforces it, and the call then has none).
WEEK = 7 * 24 * 60 * 60
DURATIONS = ("rank_stall_timeout", "reward_timeout", "ddp_timeout", "vllm_server_timeout")
UPPER_BOUNDS = {
    "min_pixels": PIXEL_CEILING,
    "max_pixels": PIXEL_CEILING,
    "image_pixels": PIXEL_CEILING,
    **dict.fromkeys(DURATIONS, WEEK),
}
ABOVE_ZERO = ("temperature", "vllm_server_timeout")  # sampling divides the logits by it; 0 s: no server is up yet
HINTS = {
    "max_steps": " (-1, the default, trains num_train_epochs)",
    "token_check_samples": " (-1 checks every prompt, 0 none)",
    "rank_stall_timeout": " (0 turns the watch off)",
    "reward_timeout": " (0: no limit)",
}
# Why a value above a key's upper bound is refused.
TOO_HIGH = {
    **dict.fromkeys(
        ("min_pixels", "max_pixels", "image_pixels"),
        f"no image above {PIXEL_CEILING:,} pixels is decoded, so a larger limit means nothing",
    ),
    **dict.fromkeys(DURATIONS, f"{WEEK:,} s is a week, far above any real wait, and a longer one only hides a hang"),
}


def bound_error(key: str, value: float, name: str | None = None) -> str | None:
    """What is wrong with `value` for `key` (shown as `name`, e.g. `--num_processes`), or None if it is in range."""
    name = name or f"`{key}`"
    low, high = LOWER_BOUNDS.get(key), UPPER_BOUNDS.get(key)
    if low is not None and value < low:
        return f"{key} must be at least {low}, got {value}; set {name} to {low} or more{HINTS.get(key, '')}"
    if high is not None and value > high:
        why, hint = TOO_HIGH[key], HINTS.get(key, "")
        return f"{key} must be at most {high:,}, got {value:,}: {why}; set {name} to {high:,} or less{hint}"
    if key in ABOVE_ZERO and value <= 0:
        return f"{key} must be above 0, got {value}; set {name} to a positive number"
    return None


def bounded_int(key: str) -> Callable[[str], int]:
    """An argparse `type` for the flag `--<key>`: an integer within the table's bounds, else argparse's error naming
    the flag (`argument --num_processes: num_processes must be at least 1, got 0; …`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if error := bound_error(key, value, f"--{key}"):
            raise argparse.ArgumentTypeError(error)
        return value

    return parse
