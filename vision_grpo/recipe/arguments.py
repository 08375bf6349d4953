"""The recipe keys of our own: `BaseTaskArguments` (what every task shares) and `TaskArguments`, the same class with
the keys each task plugin declares (its `Options`), flat, as one dataclass; `RecipeError` for a recipe that cannot run.

TRL's trainer configs and `ModelConfig` hold the rest of a recipe's keys; vision_grpo/recipe/parse.py reads a recipe
into all of them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from vision_grpo.plugins.tasks import TaskPluginError, discover, task_of

# The logprob-gap guard's default (nats; vision_grpo/training/logprob_guard.py). Why this value: docs/evaluation.md,
# "The logprob-gap guard". A recipe key's default, so it lives with the keys.
LOGPROB_GAP_THRESHOLD = 0.08
# A rank's heartbeat stops only when its whole process stops, so this needs no room for long steps or a long hash on
# the main process; it is room for a process starved of CPU, or a C call holding the GIL, on a loaded machine.
RANK_STALL_TIMEOUT = 300
# Seconds one call of a reward (a batch of completions) may take: far above what a parser needs (the VQA rewards
# take milliseconds), room for a reward that asks a remote judge, short of a run that hangs for good.
REWARD_TIMEOUT = 600


class RecipeError(ValueError):
    """A recipe that cannot run: unknown key, wrong type, inconsistent values."""


@dataclass
class BaseTaskArguments:
    """Everything of a recipe that TRL's own configs do not cover and every task shares: which task, data source,
    images, rewards, vision tower, the supervised warm start, held-out curves. Each task adds its own keys (its
    `Options`, see vision_grpo/plugins/tasks.py); `TaskArguments` is this class with the keys of the tasks in
    `data/`."""

    task: str = field(default="shapes", metadata={"help": "A task's NAME: `shapes`, `geoqa`, `vqa` or a plugin's."})
    task_dirs: list[str] = field(
        default_factory=list, metadata={"help": "Extra folders of task plugins (their code is run)."}
    )
    dataset_name: str = field(default="hz2475/geoQA", metadata={"help": "Hub id or local parquet/save_to_disk path."})
    dataset_revision: str | None = field(default=None, metadata={"help": "Hub revision (commit) to pin."})
    skip_bad_rows: bool = field(default=False, metadata={"help": "Skip and count invalid rows instead of failing."})
    # Images.
    min_pixels: int | None = field(default=None, metadata={"help": "Processor's lower pixel limit per image."})
    max_pixels: int | None = field(default=None, metadata={"help": "Processor's upper pixel limit per image."})
    token_check_samples: int = field(
        default=32,
        metadata={
            "help": "Prompts whose image-token count is checked before training (-1: all of them at the first start "
            "with these rows, processor and model, then a sample of 32)."
        },
    )
    # Rewards.
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward names from rewards/ (and `reward_dirs`); weights in `reward_weights`. Default: "
            "the task's DEFAULT_REWARDS."
        },
    )
    reward_dirs: list[str] = field(
        default_factory=list, metadata={"help": "Extra folders of reward plugins (their code is run)."}
    )
    reward_faults: str = field(
        default="fail",
        metadata={
            "help": "On a reward's fault, `fail` (stop naming reward, row, value) or `skip` (those completions "
            "unscored). A fault: a reward that raises, returns NaN, inf, a non-number or the wrong count, or takes "
            "longer than `reward_timeout`. `skip` gives those completions no reward and no advantage, and counts "
            "them (metric `rewards/skipped_completions`, the manifest's `skipped_completions`); a step whose every "
            "completion is skipped makes no update (metric `rewards/skipped_step`), and `reward_outage_steps` such "
            "steps in a row stop the run."
        },
    )
    reward_outage_steps: int = field(
        default=3, metadata={"help": "Steps in a row that `skip` may leave without any reward before the run stops."}
    )
    reward_timeout: float = field(
        default=REWARD_TIMEOUT, metadata={"help": "Seconds one reward call may take (0: no limit)."}
    )
    # Vision tower.
    vision_tower: str = field(default="freeze", metadata={"help": "`train`, `freeze` or `scaled_lr`."})
    vision_lr_scale: float = field(default=0.1, metadata={"help": "Learning-rate factor with `scaled_lr`."})
    lora_on_vision: bool = field(default=False, metadata={"help": "Also put LoRA adapters on the vision tower."})
    share_prompt_copies: bool = field(
        default=True,
        metadata={
            "help": "Encode each distinct image of a batch once (GRPO's G copies of a prompt share it); false: the "
            "per-copy path, for comparison or as an escape hatch."
        },
    )
    share_decode_cache: bool = field(
        default=True,
        metadata={
            "help": "Decode cache: each prompt once. HF generation keeps each prompt's keys and values once while "
            "decoding; false: a copy per row."
        },
    )
    # The training pass (vision_grpo/training/training_pass.py): each key turns one saving off. The first sentence
    # of each help is what `--help` shows: short, so that the list stays short.
    share_prompt_in_training: bool = field(
        default=True,
        metadata={
            "help": "Each prompt once per group. The training forward packs a group's completions after its prompt; "
            "false: TRL's per-copy rows."
        },
    )
    balance_micro_batches: bool = field(
        default=True,
        metadata={
            "help": "Micro-batches of whole groups. Token-balanced, cut to their own lengths; false: TRL's shuffled "
            "equal split."
        },
    )
    skip_zero_advantage: bool = field(
        default=True,
        metadata={
            "help": "Rows of advantage 0 skip. No forward or backward for them, the update unchanged; false: all "
            "rows run."
        },
    )
    dynamic_sampling_rounds: int = field(
        default=0,
        metadata={
            "help": "Dynamic sampling rounds (0: off). Groups whose rewards are all equal are replaced by groups "
            "with signal from up to this many further generation rounds of new prompts; docs/training.md."
        },
    )
    # Supervised warm start (recipes/sft.py): answer forms, `{count}` replaced by the count, drawn with weights.
    sft_targets: list[str] = field(
        default_factory=lambda: ["{count}.", "I count {count} of them, so the answer is \\boxed{{count}}."],
        metadata={"help": "Completion templates for SFT on shapes; `{count}` becomes the answer."},
    )
    sft_target_weights: list[float] = field(
        default_factory=lambda: [0.5, 0.5], metadata={"help": "Probability of each `sft_targets` form."}
    )
    # Systematically wrong demonstrations (make demo's second experiment): some rows of one count show another.
    sft_mislabel_count: int | None = field(
        default=None, metadata={"help": "Count whose SFT targets are sometimes wrong (None: all targets right)."}
    )
    sft_mislabel_as: int | None = field(default=None, metadata={"help": "The wrong count those targets show."})
    sft_mislabel_share: float = field(
        default=0.0, metadata={"help": "Share of `sft_mislabel_count` rows (per row id) shown as the wrong count."}
    )
    # Held-out accuracy during training.
    holdout_eval_steps: int = field(default=0, metadata={"help": "Greedy held-out accuracy every N steps (0: off)."})
    holdout_eval_size: int = field(default=32, metadata={"help": "Held-out examples per in-training evaluation."})
    # The vLLM logprob-gap guard (vision_grpo/training/logprob_guard.py; docs/evaluation.md has its calibration).
    logprob_gap_threshold: float = field(
        default=LOGPROB_GAP_THRESHOLD,
        metadata={"help": "vLLM only: mean sampler/trainer logprob gap (nats) the first steps allow."},
    )
    logprob_gap_action: str = field(
        default="auto",
        metadata={
            "help": "vLLM only: over the threshold, `stop` training, `warn`, or `auto`: stop on the first step "
            "(same weights in trainer and engine), later warn unless far over it."
        },
    )
    # Memory plan (vision_grpo/plan/), printed at the start of every run.
    memory_plan_check: bool = field(
        default=True,
        metadata={"help": "Refuse a run whose memory plan exceeds the GPU present beyond its error (false: skip)."},
    )
    # Several processes (vision_grpo/run/rank_watch.py).
    rank_stall_timeout: int = field(
        default=RANK_STALL_TIMEOUT,
        metadata={
            "help": "Seconds a rank may go without answering (stopped, hung, gone) before the others end the launch "
            "naming it (0: off, wait for the process group's timeout, ddp_timeout)."
        },
    )
    # Reusing a run folder.
    overwrite_run: bool = field(
        default=False, metadata={"help": "Delete the earlier run in this run folder and start over."}
    )
    resume_allow_changes: list[str] = field(
        default_factory=list,
        metadata={"help": "Recipe keys a resumed run may change from the run it continues (e.g. `learning_rate`)."},
    )

    def __post_init__(self) -> None:
        if self.vision_tower not in ("train", "freeze", "scaled_lr"):
            raise RecipeError(f"vision_tower: {self.vision_tower!r} is not one of ['train', 'freeze', 'scaled_lr']")
        if len(self.sft_targets) != len(self.sft_target_weights):
            raise RecipeError("sft_targets and sft_target_weights must have the same length")
        if (self.sft_mislabel_count is None) != (self.sft_mislabel_as is None):
            raise RecipeError("sft_mislabel_count and sft_mislabel_as go together: set both or neither")
        if self.sft_mislabel_count is not None and self.sft_mislabel_count == self.sft_mislabel_as:
            raise RecipeError("sft_mislabel_as must differ from sft_mislabel_count")
        if not 0.0 <= self.sft_mislabel_share <= 1.0:
            raise RecipeError("sft_mislabel_share must be between 0 and 1")
        if self.sft_mislabel_share > 0 and self.sft_mislabel_count is None:
            raise RecipeError("sft_mislabel_share needs sft_mislabel_count and sft_mislabel_as")
        if self.reward_faults not in ("fail", "skip"):
            raise RecipeError(f"reward_faults: {self.reward_faults!r} is not one of ['fail', 'skip']")
        if not self.vision_lr_scale > 0:
            raise RecipeError("vision_lr_scale must be positive")
        if not self.logprob_gap_threshold > 0 or self.logprob_gap_action not in ("auto", "stop", "warn"):
            raise RecipeError(
                f"logprob_gap_threshold must be positive and logprob_gap_action `auto`, `stop` or `warn`; got "
                f"{self.logprob_gap_threshold!r} and {self.logprob_gap_action!r}"
            )
        try:
            task = task_of(self)
            if task.check is not None:
                task.check(self)
        except (TaskPluginError, ValueError) as error:
            raise RecipeError(str(error)) from None
        if self.reward_funcs is None:
            self.reward_funcs = list(task.default_rewards)


@functools.cache
def arguments_class(task_dirs: tuple[str, ...] = ()) -> type:
    """`BaseTaskArguments` with the recipe keys of every task in `data/` and in `task_dirs`, flat, as one dataclass.

    A key two tasks declare, or one that shadows a shared key, is refused naming both, so no task silently changes
    another's meaning.
    """
    owners = {f.name: "the shared task arguments" for f in dataclasses.fields(BaseTaskArguments)}
    bases = []
    for task in discover(task_dirs).values():
        if task.options is None:
            continue
        for f in dataclasses.fields(task.options):
            if f.name in owners:
                where = f"task `{task.name}` ({task.source})"
                raise RecipeError(f"recipe key `{f.name}` of {where} is also in {owners[f.name]}")
            owners[f.name] = f"task `{task.name}` ({task.source})"
        bases.append(task.options)
    return dataclasses.make_dataclass("TaskArguments", [], bases=(BaseTaskArguments, *bases))


TaskArguments = arguments_class()
