"""What sharing a prompt's copies should give the real models at 1 MP, from FLOP counts (no GPU needed).

    python benchmarks/vision_once_flops.py [--completion 300] [--text 200]

Per step of G = 8 copies of one prompt, counting 2 FLOPs per parameter per token (attention's own FLOPs left out:
at 1-1.5 k tokens they are a few per cent) with the parameter counts of the real configs (vision_grpo/plan):
generation = the tower on each image, the prefill of each prompt, the decoding of each completion; training with
activation checkpointing (the recipes') = 4 passes of the language model over prompt and completion, and on the
per-copy path a frozen tower run forward, recomputed and back-propagated to its input for every copy (activation
checkpointing makes the tower's output require grad). Shared: the tower once per distinct image and step (its
features reused by the training pass), the prefill once per distinct prompt. On a GPU, decoding is bound by memory
bandwidth rather than FLOPs, so the generation ratio there will be lower than these.
"""

from __future__ import annotations

import argparse

from vision_grpo.plan import formulas as mf
from vision_grpo.plan.estimate import model_config, parameter_counts

MODELS = ("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3.5-4B")
COPIES = 8


def estimate(name: str, text: int, completion: int) -> dict[str, float]:
    config = model_config(name)
    shape = mf.shape_of(config)
    counts = parameter_counts(config, 0, False, None)
    language = counts["total"] - counts["vision"] - shape.vocab * shape.hidden
    patches, tokens = mf.image_tokens(shape, 1_000_000)
    vision = 2 * counts["vision"] * patches
    prefill = 2 * language * (tokens + text)
    decode = 2 * language * completion
    train = 4 * 2 * language * (tokens + text + completion)
    g = COPIES
    per_copy_generation = g * (vision + prefill + decode)
    shared_generation = vision + prefill + g * decode
    per_copy_step = per_copy_generation + g * (3 * vision + train)
    shared_step = shared_generation + g * train
    return {
        "vision_tflop": vision / 1e12,
        "prefill_tflop": prefill / 1e12,
        "step_ratio": per_copy_step / shared_step,
        "generation_ratio": per_copy_generation / shared_generation,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completion", type=int, default=300, help="completion tokens per copy")
    parser.add_argument("--text", type=int, default=200, help="prompt text tokens besides the image's")
    args = parser.parse_args()
    for name in MODELS:
        e = estimate(name, args.text, args.completion)
        print(
            f"{name}: tower {e['vision_tflop']:.1f} TFLOP and prefill {e['prefill_tflop']:.1f} TFLOP per 1-MP prompt; "
            f"step per-copy / shared {e['step_ratio']:.2f}x (frozen tower), generation {e['generation_ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
