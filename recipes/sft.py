"""Supervised warm start (SFT cold start) of a vision-language model from a recipe, on TRL's SFTTrainer.

    accelerate launch recipes/sft.py --config recipes/shapes/tiny_sft.yaml

A random-weight or weak policy earns no reward, so GRPO has no gradient; a short supervised stage on the task's
answer forms gives it something to improve. Same data, prompts and image normalisation as `recipes/train.py`.
"""

from __future__ import annotations

import vision_grpo.run.launched  # first: a launcher killed while the imports below run stops this worker too

# isort: split
import logging
import sys
from pathlib import Path

from trl import SFTConfig, SFTTrainer

from vision_grpo.data import get_rows, with_sft_completions
from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
from vision_grpo.models.lora import check_lora_targets, get_peft_config
from vision_grpo.models.vision import freeze_vision_tower
from vision_grpo.run.recipe_run import RecipeRun
from vision_grpo.run.stopping import GracefulStop

logger = logging.getLogger("vision_grpo.sft")


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    with RecipeRun.start(SFTConfig, argv) as run:  # fails on a bad recipe before anything loads; holds the run folder
        return run.close() if run.finished else train(run)  # finished: resumed after its last step, nothing to do


def train(run: RecipeRun) -> Path:
    task_args, training_args, model_args = run.task_args, run.training_args, run.model_args

    processor = get_processor(model_args, task_args, training_args.trust_remote_code)
    model = load_model(model_args, training_args.trust_remote_code)
    peft_config = get_peft_config(model_args, task_args)
    check_lora_targets(model, peft_config)  # each entry names a layer the model has (peft checks only all at once)
    if task_args.vision_tower == "freeze":
        freeze_vision_tower(model)

    train_rows = get_rows(task_args, "train", max_pixels_of(processor))
    train_dataset = with_sft_completions(
        train_rows.dataset,
        task_args.sft_targets,
        task_args.sft_target_weights,
        mislabel_count=task_args.sft_mislabel_count,
        mislabel_as=task_args.sft_mislabel_as,
        mislabel_share=task_args.sft_mislabel_share,
    )

    # The rows hold what their images are decoded or drawn from (an encoded column, a shapes index), which the
    # model's signature does not name: the Trainer's column pruning would drop it before the decoding transform runs
    # (GRPOConfig already defaults to keeping every column).
    training_args.remove_unused_columns = False
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=processor,
        peft_config=peft_config,
    )
    trainer.add_callback(GracefulStop(trainer.accelerator))  # a signal: a checkpoint after this step, then stop
    return run.train_and_save(trainer, processor, {"train": train_rows.unused})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with vision_grpo.run.launched.errors_named_first():
        main()
    vision_grpo.run.launched.finish()
