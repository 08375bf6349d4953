"""LoRA of a recipe: the peft config (`get_peft_config`), and `lora_target_modules` checked against the model before
training is set up, each entry on its own.

peft refuses a list only when no entry matched anything ("No modules were targeted for adaptation", naming no
module), and trains on silently when one entry of several is a typo. Each entry here must name a module of the
model that LoRA may adapt, or the run fails naming the entry and the layer names the model has.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists

from vision_grpo.models.vision import VISION_MODULE_PATTERN
from vision_grpo.recipe.arguments import RecipeError


def get_peft_config(model_args: Any, task_args: Any) -> LoraConfig | None:
    """LoRA on every linear layer of the language model (the vision tower only if `lora_on_vision`), or None.

    `all-linear` plus an exclusion pattern works for every Qwen-VL family, whose module names differ (Qwen3.5 has
    linear-attention projections that a fixed list would miss).
    """
    if not model_args.use_peft:
        return None
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules or "all-linear",
        exclude_modules=None if task_args.lora_on_vision else VISION_MODULE_PATTERN,
        modules_to_save=model_args.lora_modules_to_save,
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
    )


def check_lora_targets(model: torch.nn.Module, peft_config: LoraConfig | None) -> None:
    """Refuse a `lora_target_modules` entry that matches no module of `model` (after the vision tower's exclusion),
    listing the names of its linear layers. `all-linear` (the default) always matches."""
    if peft_config is None or isinstance(peft_config.target_modules, str):
        return
    names = [name for name, _ in model.named_modules() if name]
    for entry in sorted(peft_config.target_modules):
        alone = dataclasses.replace(peft_config, target_modules=[entry])
        if any(check_target_module_exists(alone, name) for name in names):
            continue
        layers = linear_layer_names(model, peft_config)
        nearest = difflib.get_close_matches(entry, layers, n=1)
        hint = f"did you mean `{nearest[0]}`? " if nearest else ""
        unexcluded = dataclasses.replace(alone, exclude_modules=None)
        where = (
            "only in the vision tower, which LoRA leaves alone unless `lora_on_vision: true`"
            if any(check_target_module_exists(unexcluded, name) for name in names)
            else f"no module of {getattr(model, 'name_or_path', 'the model')}"
        )
        raise RecipeError(
            f"lora_target_modules: `{entry}` names {where}; {hint}the language model's linear layers are "
            f"{layers}; name some of them, or leave lora_target_modules unset to adapt every one"
        )


def linear_layer_names(model: torch.nn.Module, peft_config: LoraConfig) -> list[str]:
    """The last part of the name of each linear layer LoRA may adapt here (the vision tower's excluded unless
    `lora_on_vision`), sorted: what a `lora_target_modules` entry names."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
            and check_target_module_exists(dataclasses.replace(peft_config, target_modules=[name]), name)
        }
    )
