"""Memory plan of a recipe: the expected peak GPU memory per rank, part by part, before anything is loaded.

    python -m vision_grpo.plan --config recipes/geoqa/qwen3_5_4b_lora.yaml [--num_processes N]
        [--accelerate_config accelerate_configs/zero3.yaml] [--image_pixels P] [--prompt_text_tokens T]
        [--images_per_prompt K] [--gated_deltanet_path auto|kernels|torch] [--expected_completion_length C]
        [--dead_group_share S] [--key value ...]

It reads the model's config only (a local folder's config.json, a copy shipped in vision_grpo/plan/model_configs/ for
the shipped GPU recipes, or the Hugging Face cache), builds the model on the meta device to count its parameters,
and applies vision_grpo/plan/formulas.py. Qwen3.5's Gated DeltaNet layers are counted on the path they take on this
machine (the flash-linear-attention + causal-conv1d kernels, or transformers' torch fallback); the first line names
it, and `--gated_deltanet_path kernels` plans a GPU machine with the `gpu` extra from anywhere. With the packed
training pass (`share_prompt_in_training`, the default) a micro-batch is planned with C tokens per completion (the
GeoQA seed's mean, 279, unless `--expected_completion_length` says otherwise) and S of the groups left out of the
pass (`--dead_group_share`, default 0: it changes the tokens per step, not the peak). Training prints the
same plan and refuses to start when it exceeds the GPU that is present (recipe key `memory_plan_check: false` skips
the refusal). docs/memory.md compares each part with measurements and says what only a GPU run can confirm.
"""

from __future__ import annotations

import sys

from vision_grpo.plan.check import recipe_plan
from vision_grpo.recipe.arguments import RecipeError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    if "--config" not in argv:
        print(
            "usage: python -m vision_grpo.plan --config <recipe> [--num_processes N] [--key value ...]", file=sys.stderr
        )
        return 2
    try:
        plan, _ = recipe_plan(argv)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("\n".join(plan.lines()))
    return 0
