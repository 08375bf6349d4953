"""What `make demo` and `make experiment-perception` run: the experiments (a warm-start recipe, GRPO from it, and
optionally the SFT control) and the settings every stage shares; a further experiment is one more `Experiment` in
`EXPERIMENTS`.
"""

from __future__ import annotations

import dataclasses
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


# Checkpoints of each arm on the compute curve (the GRPO recipe's save_steps gives its own; the control's follow).
CURVE_POINTS = 6
# A second GRPO arm's checkpoints: dense, so that one lies close to the first arm's compute (its McNemar test).
VARIANT_POINTS = 12


@dataclass(frozen=True)
class Experiment:
    """A warm start, GRPO from it and, with `sft_control`, the warm start trained further with SFT instead."""

    key: str  # `--experiments` names it; its report section: <results dir>/sections/<key>.md
    title: str
    sft_recipe: str
    run_suffix: str  # run folders: runs/shapes/<recipe>/<run name><suffix>
    results_prefix: str  # result files: <results dir>/<prefix><model>.json
    sft_control: bool
    # The GRPO stage's recipe; its task and held-out images are every model's evaluation.
    grpo_recipe: str = GRPO_RECIPE
    # Held-out accuracy of GRPO's and the control's checkpoints against their token-passes (demo/curve.py).
    compute_curve: bool = False
    # A second GRPO arm from the same warm start, in place of the SFT control: its label and its recipe flags.
    variant: tuple[str, tuple[str, ...]] | None = None
    # Held-out sets the arms are evaluated on instead of the recipe's own (demo/generalization.py): name, flags.
    held_out_variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Every training stage's seed in place of its recipe's (`--seed` of the demo); None: the recipes' own.
    seed: int | None = None

    def seeded(self, seed: int) -> Experiment:
        """This experiment trained with `seed`: its runs, result files and report section named by it, so that
        seeds side by side share nothing (the held-out images stay the same: each seed's tests are paired)."""
        return dataclasses.replace(
            self,
            title=f"{self.title} (seed {seed})",
            run_suffix=f"-seed{seed}{self.run_suffix}",
            results_prefix=f"seed{seed}_{self.results_prefix}",
            seed=seed,
        )

    @property
    def section(self) -> str:
        """The name of its report section, `<results dir>/sections/<section>.md`."""
        return self.key if self.seed is None else f"{self.key}-seed{self.seed}"

    @property
    def focus_count(self) -> int | None:
        """The count the warm start's demonstrations get wrong (its recipe's `sft_mislabel_count`), if any."""
        return yaml.safe_load((REPO / self.sft_recipe).read_text(encoding="utf-8")).get("sft_mislabel_count")


# Experiment 5's held-out sets, fixed before any model was evaluated on them (docs/demo.md says why these): the
# in-distribution set first (the baseline of every drop), then each look the training images never have, with an
# evaluation seed of its own; n = 300 each, as the recipe's held-out set.
OUT_OF_DISTRIBUTION = (
    ("in distribution", ()),
    ("unseen colour", ("--shapes_fill_color", "orange", "--shapes_eval_seed", "21")),
    ("small shapes", ("--shapes_size_range", "5", "9", "--shapes_eval_seed", "22")),
    ("noisy background", ("--shapes_background", "noise", "--shapes_eval_seed", "23")),
)


EXPERIMENTS = (
    Experiment("format", "Experiment 1: GRPO teaches the answer format", "recipes/shapes/tiny_sft.yaml", "", "", False),
    Experiment(
        "biased",
        "Experiment 2: GRPO corrects biased demonstrations",
        "recipes/shapes/tiny_sft_biased.yaml",
        "-biased",
        "biased_",
        True,
    ),
    # Counting 1-5 shapes of random sizes: the warm start's errors are miscounts (docs/demo.md, Experiment 3).
    Experiment(
        "perception",
        "Experiment 3: GRPO against SFT where perception limits the model",
        "recipes/shapes/tiny_sft_perception.yaml",
        "-perception",
        "perception_",
        True,
        grpo_recipe="recipes/shapes/tiny_grpo_perception.yaml",
        compute_curve=True,
    ),
    # Experiment 3's warm start and GRPO (reused when finished), and GRPO with dynamic sampling beside it: does
    # filling each batch with groups that have a signal pay, per unit of compute? (docs/demo.md, Experiment 4)
    Experiment(
        "dynamic",
        "Experiment 4: dynamic sampling, per unit of compute",
        "recipes/shapes/tiny_sft_perception.yaml",
        "-perception",
        "dynamic_",
        False,
        grpo_recipe="recipes/shapes/tiny_grpo_perception.yaml",
        compute_curve=True,
        variant=("GRPO + dynamic sampling", ("--dynamic_sampling_rounds", "3")),
    ),
    # Experiment 3's arms (reused when finished: the same runs) on held-out sets out of the training distribution.
    Experiment(
        "generalization",
        "Experiment 5: GRPO against SFT out of distribution",
        "recipes/shapes/tiny_sft_perception.yaml",
        "-perception",
        "generalization_",
        True,
        grpo_recipe="recipes/shapes/tiny_grpo_perception.yaml",
        compute_curve=True,
        held_out_variants=OUT_OF_DISTRIBUTION,
    ),
)


# `make demo`'s experiments; `make experiment-perception` runs the third (`--experiments perception`),
# `make experiment-dynamic-sampling` the fourth, `make experiment-generalization` the fifth.
DEMO_EXPERIMENTS = ("format", "biased")
