"""Trainer callbacks that make runs comparable: the recipe's knobs in TensorBoard's HParams view, and a greedy
held-out accuracy curve measured with the evaluator's own code (so the curve and `eval/evaluate.py` agree).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2, summary_v2
from torch.utils.tensorboard import SummaryWriter
from transformers import Trainer, TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from vision_grpo.data import get_dataset
from vision_grpo.eval.scoring import summarize
from vision_grpo.evaluator import Evaluator, chunks, default_max_new_tokens, read_batch
from vision_grpo.modeling import max_pixels_of

logger = logging.getLogger(__name__)

HParamValue = bool | int | float | str
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


def recipe_hparams(task_args: Any, training_args: Any, model_args: Any) -> dict[str, HParamValue]:
    """The knobs runs are sorted and filtered by in TensorBoard, one column each (LoRA rank 0: full fine-tuning).

    Reward weights get one column per reward (`reward_weight/<name>`), so a weight can be filtered numerically.
    """
    weights = training_args.reward_weights or [1.0] * len(task_args.reward_funcs)
    hparams: dict[str, Any] = {
        "task": task_args.task,
        "model": model_args.model_name_or_path,
        "lora_r": model_args.lora_r if model_args.use_peft else 0,
        "learning_rate": training_args.learning_rate,
        "num_generations": training_args.num_generations,
        "per_device_train_batch_size": training_args.per_device_train_batch_size,
        "max_completion_length": training_args.max_completion_length,
        "temperature": training_args.temperature,
        "loss_type": training_args.loss_type,
        "scale_rewards": training_args.scale_rewards,
        "beta": training_args.beta,
        "vision_tower": task_args.vision_tower,
        "lora_on_vision": task_args.lora_on_vision,
        "seed": training_args.seed,
        **{f"reward_weight/{name}": float(w) for name, w in zip(task_args.reward_funcs, weights, strict=True)},
    }
    if task_args.vision_tower == "scaled_lr":
        hparams["vision_lr_scale"] = task_args.vision_lr_scale
    return {key: _hparam_value(value) for key, value in hparams.items()}


def _hparam_value(value: Any) -> HParamValue:
    """HParams accept only bool, number and string; anything else (None, lists, enums) is shown as text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return "none" if value is None else str(getattr(value, "value", value))


class TensorBoardHParams(TrainerCallback):
    """Write the run's hyper-parameters to TensorBoard's HParams view, in the run folder, from the main process.

    Only the session (its hyper-parameters, start, and a success mark at the end) is written, not an experiment
    summary: TensorBoard then takes the columns from all runs under `--logdir` together and the metric columns
    from the runs' own scalars, showing each run's final values. (With per-run experiment summaries it would
    take the first run's columns for every run.) Written at train start, so a running or crashed run shows too.
    """

    def __init__(self, log_dir: str | Path, hparams: dict[str, HParamValue]) -> None:
        self.log_dir = Path(log_dir)
        self.hparams = hparams
        self.writer: SummaryWriter | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.writer = SummaryWriter(log_dir=str(self.log_dir))
            self._write(summary_v2.hparams_pb(self.hparams))

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time())
            summary = summary_pb2.Summary()
            summary.value.add(
                tag=metadata.SESSION_END_INFO_TAG,
                metadata=metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(session_end_info=end)),
                tensor=metadata.NULL_TENSOR,
            )
            self._write(summary)
            self.writer.close()
            self.writer = None

    def _write(self, summary: summary_pb2.Summary) -> None:
        self.writer.file_writer.add_summary(summary)
        self.writer.flush()


class HoldoutAccuracy(TrainerCallback):
    """Greedy accuracy on a few held-out rows at step 0, every `every` steps and at the last step.

    Generation and scoring are `Evaluator.generate`/`record` and `summarize`, as in `eval/evaluate.py`, with the same
    explicit greedy generation config and the same number of new tokens (`default_max_new_tokens`); the config is
    written to `holdout_decoding.json` in the run folder. Runs on the main process only, while the other ranks
    wait at their next collective; under ZeRO-3 the weights are sharded across ranks, so it refuses to start.
    The metrics go through `Trainer.log` (TensorBoard tags `train/holdout/...`), not `GRPOTrainer.log`, which
    would fold TRL's buffered training metrics into this entry and clear them.
    """

    def __init__(
        self, trainer: Trainer, rows: Any, task: str, reward_funcs: list, every: int, max_new_tokens: int
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

    @classmethod
    def from_recipe(cls, trainer: Trainer, task_args: Any, reward_funcs: list) -> HoldoutAccuracy:
        """The first `holdout_eval_size` rows of the task's held-out split, every `holdout_eval_steps` steps."""
        dataset = get_dataset(task_args, "eval", max_pixels_of(trainer.processing_class))
        rows = dataset.select(range(min(task_args.holdout_eval_size, len(dataset))))
        max_new_tokens = default_max_new_tokens(task_args, trainer.args)
        return cls(trainer, rows, task_args.task, reward_funcs, task_args.holdout_eval_steps, max_new_tokens)

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
        if not state.is_world_process_zero:
            return
        start = time.perf_counter()
        metrics = self.measure()
        logger.info("held-out step %d: %s (%.1f s)", state.global_step, metrics, time.perf_counter() - start)
        should_log = control.should_log  # the log event clears it, which would drop this step's training metrics
        Trainer.log(self.trainer, {f"holdout/{key}": value for key, value in metrics.items()})
        control.should_log = should_log

    def measure(self) -> dict[str, float]:
        """Summary metrics of greedy completions for the held-out rows; the model's train/eval mode is restored."""
        model, args = self.trainer.model, self.trainer.args
        was_training = model.training
        evaluator = self.evaluator()
        records = []
        try:
            for indices in chunks(range(len(self.rows)), args.per_device_eval_batch_size):
                rows, images = read_batch(self.rows, indices)
                generated = evaluator.generate(rows, images, self.max_new_tokens)
                records += [evaluator.record(row, result) for row, result in zip(rows, generated, strict=True)]
        finally:
            model.train(was_training)
        summary = summarize(records)
        metrics = {key: float(summary[key]) for key in HOLDOUT_KEYS if summary.get(key) is not None}
        metrics.update({f"rewards/{name}": value for name, value in summary["rewards"].items() if value is not None})
        return metrics
