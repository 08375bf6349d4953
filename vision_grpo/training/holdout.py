"""A greedy held-out accuracy curve during training, measured with the evaluator's own code (so the curve and
`eval/evaluate.py` agree).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from vision_grpo.data import get_rows
from vision_grpo.evaluation.batches import chunks
from vision_grpo.evaluation.evaluator import Evaluator, default_max_new_tokens
from vision_grpo.evaluation.rounds import generated_records
from vision_grpo.evaluation.scoring import summarize
from vision_grpo.models.loading import max_pixels_of

logger = logging.getLogger(__name__)

# Summary entries logged as `holdout/<key>`; the same names for every task (GeoQA has no lenient accuracy).
HOLDOUT_KEYS = (
    "accuracy",
    "lenient_accuracy",
    "format_rate",
    "conditional_accuracy",
    "hit_limit_rate",
    "mean_completion_tokens",
    "distinct_output_rate",
)


class HoldoutAccuracy(TrainerCallback):
    """Greedy accuracy on a few held-out rows at step 0, every `every` steps and at the last step.

    Generation and scoring are `Evaluator.generate`/`record` and `summarize`, as in `eval/evaluate.py`, with the same
    explicit greedy generation config and the same number of new tokens (`default_max_new_tokens`); the config is
    written to `holdout_decoding.json` in the run folder. Every process generates its own batches of the rows and
    the records are gathered (`generated_records`, as `eval/evaluate.py` does), so N processes measure in about 1/N
    of the time, get the records one process gets, and none waits for another into `ddp_timeout`; the main process
    alone logs and writes. Under ZeRO-3 every forward pass gathers the sharded weights from all ranks, so ranks
    that generate different batches (or none, in a last round) would wait for each other: it refuses to start.
    The metrics go through `Trainer.log` (TensorBoard tags `train/holdout/...`), not `GRPOTrainer.log`, which
    would fold TRL's buffered training metrics into this entry and clear them.
    """

    def __init__(
        self,
        trainer: Trainer,
        rows: Any,
        task: str,
        reward_funcs: list,
        every: int,
        max_new_tokens: int,
        rows_unused: dict[str, int] | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"held-out evaluation every {every} steps: must be at least 1")
        if is_deepspeed_zero3_enabled():
            raise ValueError("holdout_eval_steps does not work with DeepSpeed ZeRO-3 (sharded weights); set it to 0")
        self.trainer = trainer
        self.rows = rows  # a Dataset: each measurement reads (and decodes) one batch at a time
        self.task = task
        self.reward_funcs = reward_funcs
        self.every = every
        self.max_new_tokens = max_new_tokens
        self.rows_unused = rows_unused or {}  # the split's rows its task left out, by reason (the manifest's)

    @classmethod
    def from_recipe(cls, trainer: Trainer, task_args: Any, reward_funcs: list) -> HoldoutAccuracy:
        """The first `holdout_eval_size` rows of the task's held-out split, every `holdout_eval_steps` steps."""
        loaded = get_rows(task_args, "eval", max_pixels_of(trainer.processing_class))
        rows = loaded.dataset.select(range(min(task_args.holdout_eval_size, len(loaded.dataset))))
        max_new_tokens = default_max_new_tokens(task_args, trainer.args)
        every = task_args.holdout_eval_steps
        return cls(trainer, rows, task_args.task, reward_funcs, every, max_new_tokens, rows_unused=loaded.unused)

    def evaluator(self) -> Evaluator:
        trainer = self.trainer
        template_kwargs = trainer.args.chat_template_kwargs or {}
        return Evaluator(trainer.model, trainer.processing_class, self.task, self.reward_funcs, template_kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            decoding = {"max_new_tokens": self.max_new_tokens, **self.evaluator().decoding(self.max_new_tokens)}
            path = Path(args.output_dir) / "holdout_decoding.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(decoding, indent=1), encoding="utf-8")
        if state.global_step == 0:
            self._log(state, control)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self._log(state, control)

    def _log(self, state, control) -> None:
        start = time.perf_counter()
        metrics = self.measure()  # on every process: each generates its share
        if not state.is_world_process_zero:
            return
        seconds, processes = time.perf_counter() - start, self.trainer.args.world_size
        logger.info("held-out step %d: %s (%.1f s, %d processes)", state.global_step, metrics, seconds, processes)
        should_log = control.should_log  # the log event clears it, which would drop this step's training metrics
        Trainer.log(self.trainer, {f"holdout/{key}": value for key, value in metrics.items()})
        control.should_log = should_log

    def measure(self) -> dict[str, float]:
        """Summary metrics of greedy completions for the held-out rows, on every process (each generates its share
        of the batches); the model's train/eval mode is restored."""
        model, args = self.trainer.model, self.trainer.args
        was_training = model.training
        evaluator = self.evaluator()
        batches = chunks(range(len(self.rows)), args.per_device_eval_batch_size)
        try:
            records = [
                record
                for round_records in generated_records(evaluator, self.rows, batches, self.max_new_tokens)
                for record in round_records
            ]
        finally:
            model.train(was_training)
        summary = summarize(records)
        metrics = {key: float(summary[key]) for key in HOLDOUT_KEYS if summary.get(key) is not None}
        metrics.update({f"rewards/{name}": value for name, value in summary["rewards"].items() if value is not None})
        return metrics
