"""The baseline of the overhead benchmark: TRL's GRPOTrainer wired by hand, with none of our entry point.

    python benchmarks/bare_trl.py --config recipes/shapes/tiny_cpu.yaml --output_dir /tmp/bare [--max_steps 10 ...]

Same model, same rows, same rewards and the same GRPOConfig values as `recipes/train.py` with that recipe; what is
left out is our wiring (recipe checks, visual-token check, run manifest, callbacks, reward plugin wrapper). The rows
come from our data builder so that both sides train on identical data; the processor comes from our loader only
because `AutoProcessor` needs torchvision, which this machine cannot have (see FINDINGS.md). Generation suppresses
the vision special tokens as our trainer does (through TRL's `generation_kwargs`): without it the two sides sampled
different completions once a vision token came up, so they did different work (`train_overhead.py` checks that
both logged the same token counts at every step).
"""

import dataclasses
import functools
import json
import sys
from pathlib import Path

import yaml
from peft import LoraConfig
from transformers import AutoModelForImageTextToText
from trl import GRPOConfig, GRPOTrainer, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.models.processing import load_processor
from vision_grpo.models.vision import vision_special_token_ids
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.rewards import counting


def _value(text: str):
    """A command-line value as the recipe's YAML would hold it (`10`, `1e-3`, `true`); anything else stays text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv: list[str]) -> None:
    """`--config <recipe.yaml>` then `--key value` overrides, as `recipes/train.py` takes them."""
    config = argv.index("--config")
    recipe = yaml.safe_load(Path(argv[config + 1]).read_text(encoding="utf-8"))
    pairs = argv[:config] + argv[config + 2 :]
    recipe.update({key[2:]: _value(value) for key, value in zip(pairs[::2], pairs[1::2], strict=True)})

    def pick(cls: type) -> dict:
        return {f.name: recipe[f.name] for f in dataclasses.fields(cls) if f.name in recipe}

    task, model_args = TaskArguments(**pick(TaskArguments)), ModelConfig(**pick(ModelConfig))

    path = resolve_model_path(model_args.model_name_or_path)
    processor = load_processor(path, task.min_pixels, task.max_pixels)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=model_args.dtype)
    size = processor.image_processor.size
    dataset = get_dataset(task, "train", size.get("longest_edge", size.get("max_pixels")))

    eos = [processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id]
    rewards = [getattr(counting, name) for name in recipe["reward_funcs"]]
    rewards = [functools.update_wrapper(functools.partial(f, eos_token_ids=eos), f) for f in rewards]
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,  # TRL's ModelConfig default (0.05) unless the recipe sets it
        target_modules="all-linear",
        exclude_modules=None if task.lora_on_vision else r".*(visual|vision_tower|vision_model).*",
    )
    # TRL suppresses the image token; recipes/train.py's trainer suppresses every vision special token.
    suppressed = sorted({model.config.image_token_id, *vision_special_token_ids(processor.tokenizer)})
    generation_kwargs = {**(recipe.get("generation_kwargs") or {}), "suppress_tokens": suppressed}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=GRPOConfig(**{**pick(GRPOConfig), "generation_kwargs": generation_kwargs}),
        train_dataset=dataset,
        processing_class=processor,
        peft_config=lora if model_args.use_peft else None,
    )
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1:])
