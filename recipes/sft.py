"""Supervised warm start (SFT cold start) of a vision-language model from a recipe, on TRL's SFTTrainer.

    accelerate launch recipes/sft.py --config recipes/shapes/tiny_sft.yaml

A random-weight or weak policy earns no reward, so GRPO has no gradient; a short supervised stage on the task's
answer forms gives it something to improve. Same data, prompts and image normalisation as `recipes/train.py`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from accelerate import PartialState
from trl import ModelConfig, SFTConfig, SFTTrainer

from vision_grpo.config import TaskArguments, parse_recipe, recipe_path_of
from vision_grpo.data import get_dataset, with_sft_completions
from vision_grpo.modeling import freeze_vision_tower, get_peft_config, get_processor, load_model, max_pixels_of
from vision_grpo.runs import write_run_end, write_run_start
from vision_grpo.training import GracefulStop, prepare_run_dir, resume_checkpoint

logger = logging.getLogger("vision_grpo.sft")


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    task_args, training_args, model_args = parse_recipe((TaskArguments, SFTConfig, ModelConfig), argv)
    recipe_path = recipe_path_of(argv)
    run_dir = prepare_run_dir(training_args, Path(recipe_path).stem if recipe_path else "cli")
    resume_from = resume_checkpoint(training_args.resume_from_checkpoint, run_dir)  # fails before any loading
    is_main = PartialState().is_main_process

    processor = get_processor(model_args, task_args, training_args.trust_remote_code)
    model = load_model(model_args, training_args.trust_remote_code)
    if task_args.vision_tower == "freeze":
        freeze_vision_tower(model)

    train_dataset = get_dataset(task_args, "train", max_pixels_of(processor))
    train_dataset = with_sft_completions(train_dataset, task_args.sft_targets, task_args.sft_target_weights)

    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=processor,
        peft_config=get_peft_config(model_args, task_args),
        callbacks=[GracefulStop()],
    )
    if is_main:
        facts = {"task": task_args.task, "resumed_from": resume_from}
        write_run_start(run_dir, recipe_path, argv, (task_args, training_args, model_args), **facts)
    trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model(str(run_dir))
    if is_main:
        processor.save_pretrained(str(run_dir))
        write_run_end(run_dir, global_step=trainer.state.global_step)
    return run_dir


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
