"""A guard on the gap between the logprobs vLLM sampled with and the trainer's logprobs of the same completions.

With vLLM and TRL's importance-sampling correction on (`vllm_importance_sampling_correction`, TRL's default), TRL
scores every sampled completion with the trainer's model too and logs the mean absolute per-token difference as
`sampling/sampling_logp_difference/mean` (a TensorBoard curve). When the engine generated for the same prompt with
the same weights, only numerics separate the two: float32 leaves next to nothing, bf16 kernels leave a small
noise. A broken prompt form, other pixel limits, another chat template or a weight sync that did not land all give
samples drawn from another distribution, which training then learns from silently, the importance ratio only
partly hiding it. So on the first steps a gap beyond the recipe's `logprob_gap_threshold` stops training (or warns,
`logprob_gap_action: warn`), naming those causes. The default sits above bf16 noise and below the gap of the known
prompt defect; docs/evaluation.md has the measurements and the command behind it.

Truncated sampling (`top_p < 1`, `top_k > 0`, `min_p`) changes what the gap measures: TRL asks vLLM for
`processed_logprobs`, renormalised over the tokens the truncation keeps, while the trainer's logprobs are not
truncated, so every token's gap grows by the log of the probability mass kept, which depends on the model, not on
a defect. With truncation on the guard therefore warns instead of stopping, and says why.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from vision_grpo.recipe.arguments import LOGPROB_GAP_THRESHOLD

logger = logging.getLogger(__name__)

GAP_KEY = "sampling/sampling_logp_difference/mean"
RATIO_MIN_KEY = "sampling/importance_sampling_ratio/min"
ACTIONS = ("stop", "warn")


class LogprobGapError(RuntimeError):
    """The sampler's logprobs and the trainer's disagree: the completions were not drawn from the trained policy."""


def truncation_of(args: Any) -> dict[str, float]:
    """The training config's truncated-sampling settings that are on (`top_p < 1`, `top_k > 0`, `min_p`)."""
    settings = {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    on = {"top_p": (args.top_p or 1.0) < 1.0, "top_k": (args.top_k or 0) > 0, "min_p": bool(args.min_p)}
    return {key: value for key, value in settings.items() if on[key]}


class LogprobGapGuard(TrainerCallback):
    """Stop training (`action="stop"`) or warn (`"warn"`) when the mean sampler/trainer logprob gap exceeds
    `threshold` on one of the first `steps` optimizer steps (and always on the first logged gap, whatever
    `logging_steps` is). Later steps are not checked: the policy moving between generation and scoring legitimately
    widens the gap. With truncated sampling it only warns (see the module docstring)."""

    def __init__(self, threshold: float = LOGPROB_GAP_THRESHOLD, action: str = "stop", steps: int = 5) -> None:
        if not threshold > 0 or action not in ACTIONS:
            raise ValueError(f"logprob gap guard: threshold must be positive, action one of {ACTIONS}")
        self.threshold = threshold
        self.action = action
        self.steps = steps
        self.truncation: dict[str, float] = {}
        self.gaps: list[tuple[int, float]] = []

    @classmethod
    def from_recipe(cls, task_args: Any) -> LogprobGapGuard:
        """The recipe's `logprob_gap_threshold` and `logprob_gap_action`."""
        return cls(task_args.logprob_gap_threshold, task_args.logprob_gap_action)

    def on_train_begin(self, args, state, control, **kwargs):
        self.truncation = truncation_of(args)
        if args.use_vllm and not args.vllm_importance_sampling_correction:
            logger.warning(
                "vllm_importance_sampling_correction is off: TRL does not score vLLM's samples with the trainer, so "
                "the logprob gap between them is neither logged nor guarded"
            )

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        gap = (logs or {}).get(GAP_KEY)
        if gap is None:
            return
        first = not self.gaps
        self.gaps.append((state.global_step, float(gap)))
        if (first or state.global_step <= self.steps) and gap > self.threshold:
            message = self.message(state.global_step, float(gap), logs.get(RATIO_MIN_KEY))
            if self.action == "stop" and not self.truncation:
                raise LogprobGapError(message)
            logger.warning(message)

    def message(self, step: int, gap: float, ratio_min: float | None) -> str:
        ratio = f", importance-sampling ratio down to {ratio_min:.3g}" if ratio_min is not None else ""
        text = (
            f"step {step}: mean logprob gap between vLLM's samples and the trainer is {gap:.4f} "
            f"(logprob_gap_threshold {self.threshold}){ratio}. "
        )
        if self.truncation:
            settings = ", ".join(f"{key}={value}" for key, value in self.truncation.items())
            text += (
                f"Sampling is truncated ({settings}): vLLM's logprobs are renormalised over the kept tokens and the "
                "trainer's are not, which widens the gap by itself, so this is a warning, not a stop. To check the "
                "prompt path, run a few steps with top_p 1.0, top_k 0 and no min_p. Otherwise the "
            )
        else:
            text += "The engine generated for another prompt or another model. The "
        return text + (
            "likely causes: the prompt form (image placeholders expanded twice: VisionGRPOTrainer collapses them; a "
            "plain GRPOTrainer does not), pixel limits (the recipe's min_pixels/max_pixels must reach vLLM; a vLLM "
            "server needs them in --mm-processor-kwargs), the chat template (server and trainer must render the same "
            "one), or the weight sync (new weights did not reach the engine, e.g. a stale tied lm_head after full "
            "fine-tuning). Bf16 numerics alone stay well below the default threshold (docs/evaluation.md); "
            "logprob_gap_threshold raises it, logprob_gap_action: warn keeps training."
        )
