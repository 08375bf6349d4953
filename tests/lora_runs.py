"""Run folders holding a trained-like LoRA adapter or full model of a replica, as recipes/train.py leaves them
(resolved recipe.yaml, manifest.json with the base's weights by content), for the export tests here and in
tests_vllm/. The weights are random and non-zero where training would have changed them: LoRA's B starts at zero,
so an untrained adapter would change no answer and a test of merging could not fail."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from peft import get_peft_model
from trl import GRPOConfig, ModelConfig

from vision_grpo.models.loading import get_processor, load_model
from vision_grpo.models.lora import get_peft_config
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.run.manifest import model_identity

# Other pixel limits than the replicas' own: the exported processor must carry the recipe's.
PIXELS = {"min_pixels": 40000, "max_pixels": 50176}


def write_run(run_dir: Path, replica: str, recipe_file: str, **recipe_keys) -> tuple[TaskArguments, ModelConfig]:
    """A run folder as recipes/train.py leaves it (resolved recipe.yaml, manifest.json), for the weights added by
    the caller."""
    run_dir.mkdir(parents=True)
    recipe = {
        **yaml.safe_load(Path(recipe_file).read_text()),
        "model_name_or_path": replica,
        "shapes_eval_size": 6,
        **PIXELS,
        **recipe_keys,
    }
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    manifest = {
        "recipe": recipe_file,
        "argv": ["--config", recipe_file, "--model_name_or_path", replica],
        "model_weights": model_identity(replica, None),
        "dataset": {"name": "shapes"},
        "global_step": 4,
        "git": {"commit": "0" * 40},
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    configs = (TaskArguments, GRPOConfig, ModelConfig)
    task_args, _, model_args = parse_recipe(configs, ["--config", str(run_dir / "recipe.yaml")])
    return task_args, model_args


def randomise(model: torch.nn.Module, names: str, std: float) -> None:
    """Random weights for parameters whose name holds `names` (LoRA's B starts at zero: merging would change
    nothing and the test could not fail)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if names in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def lora_run(run_dir: Path, replica: str, recipe_file: str, lora_on_vision: bool = False) -> Path:
    """A run folder holding a LoRA adapter of `replica` with random non-zero weights."""
    task_args, model_args = write_run(run_dir, replica, recipe_file, lora_on_vision=lora_on_vision)
    model = get_peft_model(load_model(model_args), get_peft_config(model_args, task_args))
    randomise(model, "lora_B", std=0.5)
    model.save_pretrained(run_dir)
    get_processor(model_args, task_args).save_pretrained(run_dir)
    return run_dir
