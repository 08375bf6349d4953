"""GRPO training of a vision-language model from a recipe, on TRL's GRPOTrainer.

    accelerate launch recipes/train.py --config recipes/shapes/tiny_cpu.yaml [--key value ...]

Stages: parse the recipe -> processor -> rewards -> dataset -> model -> TRL's GRPOTrainer -> train -> save.
"""

from __future__ import annotations

import vision_grpo.run.launched  # first: a launcher killed while the imports below run stops this worker too

# isort: split
import logging
import sys
from pathlib import Path

from trl import GRPOConfig

from vision_grpo.data import get_rows
from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
from vision_grpo.models.lora import check_lora_targets, get_peft_config
from vision_grpo.models.vision import freeze_vision_tower
from vision_grpo.models.visual_tokens import check_visual_tokens
from vision_grpo.plan.check import check_before_training
from vision_grpo.rewards import get_recipe_rewards
from vision_grpo.run.recipe_run import RecipeRun
from vision_grpo.run.stopping import GracefulStop
from vision_grpo.training.holdout import HoldoutAccuracy
from vision_grpo.training.hparams import TensorBoardHParams, recipe_hparams
from vision_grpo.training.logprob_guard import LogprobGapGuard
from vision_grpo.training.trainer import VisionGRPOTrainer, check_prompts_per_step

logger = logging.getLogger("vision_grpo.train")


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    # The recipe parsed (vision_grpo/recipe/parse.py; our keys: recipe/arguments.py), the run folder held: a bad
    # recipe fails before anything loads.
    with RecipeRun.start(GRPOConfig, argv) as run:
        return run.close() if run.finished else train(run)  # finished: resumed after its last step, nothing to do


def train(run: RecipeRun) -> Path:
    task_args, training_args, model_args = run.task_args, run.training_args, run.model_args
    check_before_training(task_args, training_args, model_args)  # memory plan; refuses a run this GPU cannot hold

    # Processor and model: the same loaders for the embedded tiny model and Hub checkpoints.
    processor = get_processor(model_args, task_args, training_args.trust_remote_code)
    # Rewards: plugins from rewards/ (and `reward_dirs`), picked by name; loaded before the model so that a typo in
    # a reward name fails in seconds, not after a multi-GB model load.
    reward_funcs = get_recipe_rewards(task_args, processor.tokenizer)
    # Dataset: prompts and normalised images (the multimodal collator), read before the model so that data that
    # cannot fill one step fails in seconds; checked below against what the model consumes.
    train_rows = get_rows(task_args, "train", max_pixels_of(processor))
    train_dataset = train_rows.dataset
    check_prompts_per_step(len(train_dataset), training_args)
    model = load_model(model_args, training_args.trust_remote_code)
    peft_config = get_peft_config(model_args, task_args)
    check_lora_targets(model, peft_config)  # each entry names a layer the model has (peft checks only all at once)
    if task_args.vision_tower == "freeze":
        freeze_vision_tower(model)

    checked = check_visual_tokens(
        train_dataset,
        processor,
        model.config,
        task_args.token_check_samples,
        training_args.chat_template_kwargs or {},
        (task_args.min_pixels, task_args.max_pixels),
    )
    logger.info("%d training prompts; image-token count checked on %d", len(train_dataset), checked)

    trainer = VisionGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=processor,
        peft_config=peft_config,
        callbacks=[TensorBoardHParams(run.run_dir, recipe_hparams(task_args, training_args, model_args))],
        vision_lr_scale=task_args.vision_lr_scale if task_args.vision_tower == "scaled_lr" else None,
        logprob_guard=LogprobGapGuard.from_recipe(task_args),
        share_prompt_copies=task_args.share_prompt_copies,
        share_decode_cache=task_args.share_decode_cache,
        share_prompt_in_training=task_args.share_prompt_in_training,
        balance_micro_batches=task_args.balance_micro_batches,
        skip_zero_advantage=task_args.skip_zero_advantage,
        dynamic_sampling_rounds=task_args.dynamic_sampling_rounds,
        skip_reward_faults=task_args.reward_faults == "skip",
        reward_outage_steps=task_args.reward_outage_steps,
    )
    trainer.add_callback(GracefulStop(trainer.accelerator))  # a signal: a checkpoint after this step, then stop
    rows_unused = {"train": train_rows.unused}  # the source's rows left out, by reason: the manifest counts them
    if task_args.holdout_eval_steps > 0:
        holdout = HoldoutAccuracy.from_recipe(trainer, task_args, reward_funcs)
        trainer.add_callback(holdout)
        rows_unused["eval"] = holdout.rows_unused
    return run.train_and_save(trainer, processor, rows_unused)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with vision_grpo.run.launched.errors_named_first():
        main()
    vision_grpo.run.launched.finish()
