"""What `make demo` runs: its experiments (a warm-start recipe, GRPO from it, and optionally the SFT control) and
the settings every stage shares; a further experiment is one more `Experiment` in `EXPERIMENTS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


GRPO_RECIPE = "recipes/shapes/tiny_grpo_demo.yaml"


PASS_K = 8


EVAL_BATCH = 50


# `--quick`: the same pipeline at toy size, for the end-to-end test (numbers mean nothing there).
QUICK_SFT = ["--max_steps", "6", "--shapes_train_size", "64", "--per_device_train_batch_size", "8"]


QUICK_SFT += ["--warmup_steps", "1", "--logging_steps", "1"]  # every step logged: the control counts its tokens


QUICK_GRPO = ["--max_steps", "2", "--shapes_train_size", "32", "--per_device_train_batch_size", "16"]


QUICK_GRPO += ["--logging_steps", "1"]


QUICK_EVAL = ["--shapes_eval_size", "24"]


@dataclass(frozen=True)
class Experiment:
    """A warm start, GRPO from it and, with `sft_control`, the warm start trained further with SFT instead."""

    title: str
    sft_recipe: str
    run_suffix: str  # run folders: runs/shapes/<recipe>/<run name><suffix>
    results_prefix: str  # result files: <results dir>/<prefix><model>.json
    sft_control: bool

    @property
    def focus_count(self) -> int | None:
        """The count the warm start's demonstrations get wrong (its recipe's `sft_mislabel_count`), if any."""
        return yaml.safe_load((REPO / self.sft_recipe).read_text(encoding="utf-8")).get("sft_mislabel_count")


EXPERIMENTS = (
    Experiment("Experiment 1: GRPO teaches the answer format", "recipes/shapes/tiny_sft.yaml", "", "", False),
    Experiment(
        "Experiment 2: GRPO corrects biased demonstrations",
        "recipes/shapes/tiny_sft_biased.yaml",
        "-biased",
        "biased_",
        True,
    ),
)
