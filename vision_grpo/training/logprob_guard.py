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

The default action, `auto`, holds only the run's first step to the threshold, and only when trainer and engine then
hold the same weights: a fresh LoRA adapter's B matrices are zero, so the merged weights the engine gets equal the
base, and full fine-tuning syncs the trainer's own weights; only kernel numerics (what the threshold is calibrated
on) separate the two, and the defects above show at once. Later steps, or a first step with a warm-started adapter,
compare the trainer's float32 adapters with the engine's bf16 weights merged from them, a rounding the calibration
does not cover: there a gap over the threshold warns (giving the run's own baseline, logged when the checked steps
end) and only one over `AUTO_STOP_FACTOR` times the threshold, far above any healthy gap, stops.

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
ACTIONS = ("auto", "stop", "warn")
# `auto` stops a gap it cannot explain by rounding only above this multiple of the threshold (0.24 nats at the default,
# six times the top of the published bf16 range, docs/evaluation.md)
AUTO_STOP_FACTOR = 3.0


class LogprobGapError(RuntimeError):
    """The sampler's logprobs and the trainer's disagree: the completions were not drawn from the trained policy."""


def truncation_of(args: Any) -> dict[str, float]:
    """The training config's truncated-sampling settings that are on (`top_p < 1`, `top_k > 0`, `min_p`)."""
    settings = {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    on = {"top_p": (args.top_p or 1.0) < 1.0, "top_k": (args.top_k or 0) > 0, "min_p": bool(args.min_p)}
    return {key: value for key, value in settings.items() if on[key]}


def adapters_start_at_zero(model: Any) -> bool:
    """Whether the engine's first weights are the trainer's own: no LoRA, or every LoRA B matrix zero (PEFT's fresh
    init). An adapter sharded away by ZeRO-3 (an empty local tensor) cannot be read, so it counts as warm-started."""
    if model is None:
        return True
    for name, parameter in model.named_parameters():
        if "lora_B" in name and (parameter.numel() == 0 or bool(parameter.detach().count_nonzero())):
            return False
    return True


class LogprobGapGuard(TrainerCallback):
    """Judge the mean sampler/trainer logprob gap on the first `steps` optimizer steps (and always on the first logged
    gap, whatever `logging_steps` is): over `threshold`, `action="stop"` stops, `"warn"` warns, and `"auto"` (the
    default) stops on step 1's gap (the same weights on both sides) and otherwise warns, stopping only over
    `AUTO_STOP_FACTOR` x `threshold` (the module docstring says why). Later steps are not checked: the policy moving
    between generation and scoring legitimately widens the gap. With truncated sampling it only warns."""

    def __init__(self, threshold: float = LOGPROB_GAP_THRESHOLD, action: str = "auto", steps: int = 5) -> None:
        if not threshold > 0 or action not in ACTIONS:
            raise ValueError(f"logprob gap guard: threshold must be positive, action one of {ACTIONS}")
        self.threshold = threshold
        self.action = action
        self.steps = steps
        self.truncation: dict[str, float] = {}
        self.same_weights_at_start = True
        self.gaps: list[tuple[int, float]] = []
        self.baseline_logged = False

    @classmethod
    def from_recipe(cls, task_args: Any) -> LogprobGapGuard:
        """The recipe's `logprob_gap_threshold` and `logprob_gap_action`."""
        return cls(task_args.logprob_gap_threshold, task_args.logprob_gap_action)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.truncation = truncation_of(args)
        self.same_weights_at_start = adapters_start_at_zero(model)
        if args.use_vllm and not args.vllm_importance_sampling_correction:
            logger.warning(
                "vllm_importance_sampling_correction is off: TRL does not score vLLM's samples with the trainer, so "
                "the logprob gap between them is neither logged nor guarded"
            )

    def stop_limit(self, step: int, first: bool) -> float:
        """The gap above which this logged step stops the run (infinite: it only warns). Only step 1's gap is
        sampled before any optimizer step (a first gap logged later, `logging_steps` > 1, averages moved ones)."""
        if self.truncation or self.action == "warn":
            return float("inf")
        if self.action == "stop" or (first and step <= 1 and self.same_weights_at_start):
            return self.threshold
        return AUTO_STOP_FACTOR * self.threshold

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        gap = (logs or {}).get(GAP_KEY)
        if gap is None:
            return
        first = not self.gaps
        self.gaps.append((state.global_step, float(gap)))
        checked = first or state.global_step <= self.steps
        if checked and gap > self.threshold:
            message = self.message(state.global_step, float(gap), logs.get(RATIO_MIN_KEY))
            if gap > self.stop_limit(state.global_step, first):
                raise LogprobGapError(message)
            if self.action == "auto" and not self.truncation:
                message += (
                    f" (logprob_gap_action auto: over the threshold after the first step only a gap over "
                    f"{AUTO_STOP_FACTOR * self.threshold:.3g} stops; logprob_gap_action: stop stops at the threshold)"
                )
            logger.warning(message)
        if not checked and not self.baseline_logged:
            self.baseline_logged = True
            window = sorted(g for _, g in self.gaps[:-1])
            logger.info(
                "logprob gap baseline of this run: median %.4f, max %.4f over its first %d logged steps "
                "(logprob_gap_threshold %s)",
                window[len(window) // 2],
                window[-1],
                len(window),
                self.threshold,
            )

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
