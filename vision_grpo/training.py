"""Pieces the entry points (`recipes/train.py`, `recipes/sft.py`) assemble around TRL's trainers.

Nothing here re-implements training: the trainers are TRL's; we add the run folder, resuming from its last complete
checkpoint, the visual-token check, the vision-tower learning rate, a data order that survives a resume across
epochs, and a graceful stop on SIGINT/SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer, ModelConfig
from trl.trainer.utils import RepeatSampler

from vision_grpo.config import TaskArguments, parse_recipe, recipe_path_of
from vision_grpo.data import unused_rows
from vision_grpo.logprob_guard import LogprobGapGuard
from vision_grpo.modeling import is_vision_parameter, vision_special_token_ids
from vision_grpo.runs import dataset_identity, finished_step, write_run_end, write_run_start
from vision_grpo.threads import configure_threads
from vision_grpo.vllm_generation import VisionVLLMGeneration

logger = logging.getLogger(__name__)


@dataclass
class RecipeRun:
    """One run of an entry point: the parsed recipe, its run folder, the checkpoint to resume, the process's role.

    `recipes/train.py` and `recipes/sft.py` share it, so both record their runs and resume the same way.
    """

    task_args: TaskArguments
    training_args: Any
    model_args: Any
    argv: list[str]
    recipe_path: str | None
    run_dir: Path
    resume_from: str | None
    is_main: bool
    finished: bool = False

    @classmethod
    def start(cls, trainer_config_cls: type, argv: list[str]) -> RecipeRun:
        """Parse the recipe (fails on any bad key before loading anything) and set up the run folder.

        A resumed run that already reached its `max_steps` is `finished`: the entry point then stops without
        loading anything or touching the folder. With a larger `max_steps` it continues from its last checkpoint.
        """
        task_args, training_args, model_args = parse_recipe((TaskArguments, trainer_config_cls, ModelConfig), argv)
        configure_threads()
        recipe_path = recipe_path_of(argv)
        run_dir = prepare_run_dir(training_args, Path(recipe_path).stem if recipe_path else "cli")
        resume_from = resume_checkpoint(training_args.resume_from_checkpoint, run_dir)
        is_main = PartialState().is_main_process
        run = cls(task_args, training_args, model_args, argv, recipe_path, run_dir, resume_from, is_main)
        if resume_from is not None:
            step = finished_step(run_dir, training_args.max_steps, training_args.num_train_epochs)
            if step is not None:
                logger.warning(
                    "run %s already finished at step %d (max_steps %s): nothing to do, nothing changed; raise "
                    "max_steps to continue it",
                    run_dir,
                    step,
                    training_args.max_steps,
                )
                run.finished = True
        return run

    def train_and_save(self, trainer: Any, processor: Any) -> Path:
        """Record the run, train (resuming if asked), save the model or adapter and the processor, close the record."""
        if self.is_main:
            facts = {
                "task": self.task_args.task,
                "dataset": dataset_identity(self.task_args),
                "seed": self.training_args.seed,
                "resumed_from": self.resume_from,  # None for a fresh start
                "rows_unused": unused_rows(),  # by split and reason, as the task's loader reported them
            }
            configs = (self.task_args, self.training_args, self.model_args)
            write_run_start(self.run_dir, self.recipe_path, self.argv, configs, **facts)
        trainer.train(resume_from_checkpoint=self.resume_from)
        trainer.save_model(str(self.run_dir))
        if self.is_main:
            processor.save_pretrained(str(self.run_dir))
            write_run_end(
                self.run_dir,
                global_step=trainer.state.global_step,
                max_steps=trainer.state.max_steps,
                num_train_epochs=self.training_args.num_train_epochs,
            )
        return self.close()

    def close(self) -> Path:
        """Leave together and close the process group: a rank that exits while gloo's threads still serve another
        aborted with "terminate called without an active exception" (seen once in CI, 2 CPU processes)."""
        state = PartialState()
        state.wait_for_everyone()
        state.destroy_process_group()
        return self.run_dir


def prepare_run_dir(trainer_args: Any, recipe_name: str) -> Path:
    """Point the trainer at `runs/<task>/<recipe>/<run-name>/`: checkpoints, TensorBoard events, resolved recipe.

    The recipe's `output_dir` is the recipe's folder; the run name comes from `run_name` (recipe or `--run_name`)
    or the start time on the main process, which every process takes (ranks whose clocks straddle a second would
    otherwise write into two folders). Rerunning with the same `run_name` finds that run's checkpoints again.
    """
    run_name = trainer_args.run_name or from_main_process(datetime.now().strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(trainer_args.output_dir) / run_name
    trainer_args.output_dir = str(run_dir)
    trainer_args.run_name = run_name
    # transformers 5 reads TensorBoard's folder from this variable only (`logging_dir` is gone).
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(run_dir)
    logger.info("run %s of recipe %s in %s", run_name, recipe_name, run_dir)
    return run_dir


def from_main_process(value: Any) -> Any:
    """`value` as the main process has it, on every process (the run name here, resumed records in evaluation)."""
    if PartialState().num_processes == 1:
        return value
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


RESUME_LAST = ("true", "last")
# Written last by the Trainer's checkpoint save: a checkpoint folder without it was cut off while saving.
TRAINER_STATE = "trainer_state.json"


def resume_checkpoint(value: str | bool | None, run_dir: Path) -> str | None:
    """The checkpoint a run resumes from: `resume_from_checkpoint` as a path, or `true`/`last` for the run folder's
    last complete checkpoint (rerun with the same `output_dir` and `run_name`). None: start from scratch.

    A checkpoint cut off by a kill while saving has no `trainer_state.json`; it is skipped, not loaded half-way.
    """
    if value is None or value is False or str(value).lower() in ("", "false", "none"):
        return None
    if value is True or str(value).lower() in RESUME_LAST:
        complete = sorted(
            (p for p in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.name.split("-")[-1].isdigit()),
            key=lambda p: int(p.name.split("-")[-1]),
        )
        for partial in [p for p in complete if not (p / TRAINER_STATE).is_file()]:
            logger.warning("skipping %s: no %s (cut off while saving)", partial, TRAINER_STATE)
        complete = [p for p in complete if (p / TRAINER_STATE).is_file()]
        if not complete:
            raise FileNotFoundError(
                f"resume_from_checkpoint={value}: no complete checkpoint in {run_dir}; rerun with the interrupted "
                "run's `output_dir` and `run_name`, or pass a checkpoint folder"
            )
        return str(complete[-1])
    path = Path(str(value)).expanduser()
    if not (path / TRAINER_STATE).is_file():
        missing = "does not exist" if not path.exists() else f"has no {TRAINER_STATE} (not a complete checkpoint)"
        raise FileNotFoundError(f"resume_from_checkpoint: {path} {missing}")
    return str(path)


def fill_image(prompt: list[dict], image: Any) -> list[dict]:
    """The prompt with its image placeholders holding the row's `image`, or its list of images one slot each in order
    (how TRL and the evaluator feed the processor)."""
    images = iter(image if isinstance(image, list) else [image])
    filled = []
    for message in prompt:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "image": next(images)}
                if part["type"] == "image"
                else {"type": "text", "text": part["text"]}
                for part in content
            ]
        filled.append({"role": message["role"], "content": content})
    return filled


class VisionGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer; with `vision_lr_scale` the vision tower's parameters get their own learning rate, and
    generation never samples a vision special token.

    TRL suppresses only `image_token_id`: a sampled `<|vision_start|>` or `<|video_pad|>` reaches the training forward
    pass inside the completion, where Qwen-VL models read it as the start of an image or video that has no features.
    """

    def __init__(self, *args: Any, vision_lr_scale: float | None = None, **kwargs: Any) -> None:
        self.vision_lr_scale = vision_lr_scale
        super().__init__(*args, **kwargs)
        if not self.use_vllm:  # vLLM samples with its own logits processing
            already = self.generation_kwargs.get("suppress_tokens") or []
            suppressed = sorted(set(already) | set(vision_special_token_ids(self._tokenizer)))
            self.generation_kwargs["suppress_tokens"] = suppressed
            self.generation_config.suppress_tokens = suppressed
        else:  # un-expanded prompts into the engine, vision tokens biased away, the logprob gap guarded
            VisionVLLMGeneration.of(self.vllm_generation, self.processing_class)
            self.add_callback(LogprobGapGuard())

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        return EpochSeededSampler.of(sampler) if isinstance(sampler, RepeatSampler) else sampler

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.vision_lr_scale is not None:
            split_vision_param_group(optimizer, self.model if model is None else model, self.vision_lr_scale)
        return optimizer


def split_vision_param_group(optimizer: Any, model: Any, scale: float) -> None:
    """Move trainable vision-tower parameters into groups whose learning rate is `scale` times the others'.

    Idempotent: the Trainer may call `create_optimizer` twice for one optimizer (DeepSpeed does), and scaling the
    vision groups again would give them `scale**2`.
    """
    vision_ids = {id(p) for n, p in model.named_parameters() if is_vision_parameter(n) and p.requires_grad}
    if not vision_ids:
        raise ValueError("vision_tower: scaled_lr, but the model has no trainable vision-tower parameters")
    for group in list(optimizer.param_groups):
        if group.get("vision_tower"):
            continue
        vision = [p for p in group["params"] if id(p) in vision_ids]
        if not vision:
            continue
        group["params"] = [p for p in group["params"] if id(p) not in vision_ids]
        optimizer.add_param_group({**group, "params": vision, "lr": group["lr"] * scale, "vision_tower": True})


class EpochSeededSampler(RepeatSampler):
    """TRL's RepeatSampler whose shuffle of epoch k is drawn from `seed + k`, whenever that epoch starts.

    TRL's sampler draws each epoch's order from one generator seeded once, so a run resumed in epoch k>0 gets a fresh
    generator and repeats epoch 0's order. The Trainer calls `set_epoch` at every epoch start (resumed or not);
    reseeding there makes the order a function of (seed, epoch). Epoch 0 keeps TRL's order exactly.
    """

    @classmethod
    def of(cls, sampler: RepeatSampler) -> EpochSeededSampler:
        sampler.__class__ = cls
        return sampler

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle and self.seed is not None:
            self.generator.manual_seed(self.seed + epoch)


class GracefulStop(TrainerCallback):
    """On SIGINT/SIGTERM: finish the current step, save a checkpoint, stop. A second signal stops at once.

    With several processes the request is agreed at every step boundary (a max over the ranks), so all stop after
    the same step even when the signal reached only one of them or reached them during different steps; a rank
    that stopped alone would leave the others waiting in their next collective forever.
    """

    def __init__(self) -> None:
        self.requested = False

    def on_train_begin(self, args, state, control, **kwargs):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request)

    def _request(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        logger.warning("signal %d: saving a checkpoint after this step, then stopping", signum)
        self.requested = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.agreed():
            control.should_save = True
            control.should_training_stop = True
        return control

    def agreed(self) -> bool:
        """Whether any process was asked to stop."""
        process = PartialState()
        if process.num_processes == 1:
            return self.requested
        flag = torch.tensor([int(self.requested)], device=process.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
