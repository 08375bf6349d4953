"""A guard on the gap between the logprobs vLLM sampled with and the trainer's logprobs of the same completions.

With vLLM and TRL's importance-sampling correction on (`vllm_importance_sampling_correction`, TRL's default), TRL
scores every sampled completion with the trainer's model too and logs the mean absolute per-token difference as
`sampling/sampling_logp_difference/mean` (a TensorBoard curve). When the engine generated for the same prompt with
the same weights, it is small (0.0023 on the embedded model in float32 on CPU; bf16 on GPUs adds noise of the order
of 0.01). A broken prompt form, other pixel limits, another chat template or a weight sync that did not land all
give samples drawn from another distribution (0.10 with TRL's double image expansion), which training then learns
from silently, the importance ratio only partly hiding it. So on the first steps a gap beyond a threshold stops
training, naming those causes.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

GAP_KEY = "sampling/sampling_logp_difference/mean"
RATIO_MIN_KEY = "sampling/importance_sampling_ratio/min"


class LogprobGapError(RuntimeError):
    """The sampler's logprobs and the trainer's disagree: the completions were not drawn from the trained policy."""


class LogprobGapGuard(TrainerCallback):
    """Stop training when the mean sampler/trainer logprob gap exceeds `threshold` on one of the first `steps`
    optimizer steps (and always on the first logged gap, whatever `logging_steps` is). Later steps are not checked:
    the policy moving between generation and scoring legitimately widens the gap."""

    def __init__(self, threshold: float = 0.05, steps: int = 5) -> None:
        self.threshold = threshold
        self.steps = steps
        self.gaps: list[tuple[int, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):
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
            raise LogprobGapError(self.message(state.global_step, float(gap), logs.get(RATIO_MIN_KEY)))

    def message(self, step: int, gap: float, ratio_min: float | None) -> str:
        ratio = f", importance-sampling ratio down to {ratio_min:.3g}" if ratio_min is not None else ""
        return (
            f"step {step}: mean logprob gap between vLLM's samples and the trainer is {gap:.4f} (threshold "
            f"{self.threshold}){ratio}. The engine generated for another prompt or another model. Likely causes: "
            "the prompt form (image placeholders expanded twice: VisionGRPOTrainer collapses them; a plain "
            "GRPOTrainer does not), pixel limits (the recipe's min_pixels/max_pixels must reach vLLM; a vLLM server "
            "needs them in --mm-processor-kwargs), the chat template (server and trainer must render the same one), "
            "or the weight sync (new weights did not reach the engine, e.g. a stale tied lm_head after full "
            "fine-tuning)."
        )
