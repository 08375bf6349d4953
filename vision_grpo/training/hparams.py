"""The recipe's knobs in TensorBoard's HParams view, one column each, so runs can be sorted and filtered by them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2, summary_v2
from torch.utils.tensorboard import SummaryWriter
from transformers import TrainerCallback

HParamValue = bool | int | float | str


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
