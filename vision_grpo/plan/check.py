"""The plan of a recipe as its entry points see it: `python -m vision_grpo.plan` parses the recipe as training
would (`recipe_plan`), and `recipes/train.py` logs the plan and refuses a run whose plan exceeds the GPU present
(`check_before_training`).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

from vision_grpo.plan.estimate import (
    DEFAULT_EXPECTED_COMPLETION,
    DEFAULT_PROMPT_TEXT_TOKENS,
    accelerate_layout,
    build_plan,
)
from vision_grpo.plan.parts import PLAN_ERROR, GiB, Plan
from vision_grpo.plan.zero import launched_zero
from vision_grpo.recipe.arguments import RecipeError
from vision_grpo.recipe.bounds import bounded_int

logger = logging.getLogger("vision_grpo.plan")


def recipe_plan(argv: list[str]) -> tuple[Plan, argparse.Namespace]:
    """Parse the plan's own flags, then the recipe (with its overrides) as training would, and build the plan."""
    from trl import GRPOConfig, ModelConfig

    from vision_grpo.recipe.arguments import TaskArguments
    from vision_grpo.recipe.parse import parse_recipe, read_recipe, recipe_path_of

    own = argparse.ArgumentParser(prog="python -m vision_grpo.plan", add_help=False)
    own.add_argument("--num_processes", type=bounded_int("num_processes"))
    own.add_argument("--accelerate_config")
    own.add_argument("--image_pixels", type=bounded_int("image_pixels"))
    own.add_argument("--prompt_text_tokens", type=bounded_int("prompt_text_tokens"), default=DEFAULT_PROMPT_TEXT_TOKENS)
    own.add_argument("--images_per_prompt", type=bounded_int("images_per_prompt"), default=1)
    # Qwen3.5's Gated DeltaNet layers: plan for the path they take here (auto), or for another machine's
    own.add_argument("--gated_deltanet_path", choices=("auto", "kernels", "torch"), default="auto")
    # The packed training pass: tokens per completion it plans for, and the share of groups it leaves out
    own.add_argument(
        "--expected_completion_length",
        type=bounded_int("expected_completion_length"),
        default=DEFAULT_EXPECTED_COMPLETION,
    )
    own.add_argument("--dead_group_share", type=_share, default=0.0)
    flags, rest = own.parse_known_args(argv)
    # The plan runs anywhere: without `use_cpu` a bf16 recipe is refused by TrainingArguments on a machine with no GPU
    task_args, training_args, model_args = parse_recipe(
        (TaskArguments, GRPOConfig, ModelConfig), [*rest, "--use_cpu", "true"]
    )
    processes, zero = accelerate_layout(flags.accelerate_config, flags.num_processes)
    recipe = read_recipe(recipe_path_of(rest)) if "--config" in rest else {}  # a mapping: parse_recipe read it
    plan = build_plan(
        task_args,
        training_args,
        model_args,
        processes,
        zero,
        flags.image_pixels,
        flags.prompt_text_tokens,
        flags.images_per_prompt,
        generation_batch_set="generation_batch_size" in recipe or "--generation_batch_size" in rest,
        deltanet=None if flags.gated_deltanet_path == "auto" else flags.gated_deltanet_path,
        expected_completion=flags.expected_completion_length,
        dead_group_share=flags.dead_group_share,
    )
    return plan, flags


def _share(text: str) -> float:
    """The share of groups left out of the training pass: a fraction of at least 0 and below 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"--dead_group_share: a fraction of at least 0 and below 1, got {text!r}")
    return value


def check_before_training(task_args: Any, training_args: Any, model_args: Any) -> Plan | None:
    """Log the plan (main process) and refuse a run whose plan exceeds this GPU, before the model loads; the
    DeepSpeed layout is the one this process was launched with (`launched_zero`)."""
    from accelerate import PartialState

    state = PartialState()
    try:
        plan = build_plan(task_args, training_args, model_args, state.num_processes, launched_zero(training_args))
    except (KeyError, AttributeError, ValueError) as error:  # a model family the formulas do not cover
        logger.warning("no memory plan for %s: %s", model_args.model_name_or_path, error)
        return None
    if state.is_main_process:
        for line in plan.lines():
            logger.info(line)
    if training_args.use_cpu or not torch.cuda.is_available() or not task_args.memory_plan_check:
        return plan
    device = torch.cuda.current_device()
    card = torch.cuda.get_device_properties(device).total_memory
    verdict, name = plan.verdict(card), torch.cuda.get_device_name(device)
    said = f"memory plan: {plan.total(card) / GiB:.1f} GiB expected per GPU, and this GPU ({name}) has {card / GiB:.1f}"
    how = f"change `{plan.first_key(card)}` first (`python -m vision_grpo.plan --config <recipe>` shows every part)"
    if verdict == "does not fit":
        raise RecipeError(
            f"{said} GiB: it does not fit even if the plan is {PLAN_ERROR:.0%} high (its measured error on CPU); "
            f"{how}, or set `memory_plan_check: false` to start anyway"
        )
    if verdict == "may not fit":
        logger.warning(
            "%s GiB: within the plan's error (+-%d%%, measured on CPU) it may not fit; if it runs out of memory, %s. "
            "`memory_plan_check: false` skips this check",
            said,
            round(PLAN_ERROR * 100),
            how,
        )
    return plan
