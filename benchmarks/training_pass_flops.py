"""What the packed training pass should give the real GeoQA recipes on a GPU, from FLOP counts (no GPU needed).

    python benchmarks/training_pass_flops.py [--completion 279] [--dead 0.33] [--text 256]

One GeoQA step of the seed's recipe: 8 prompts x G = 8 completions, one 1-MP image per prompt (the recipes' pixel
cap) and `--text` text tokens, completions of `--completion` tokens on average with some at the 1,024 limit (so
TRL pads every row to 1,024). With activation checkpointing (the recipes'), a token's linear FLOPs are counted four
times (forward, recomputed forward, backward twice the forward), 2 per language-model parameter (embeddings and
the LM head aside; the head scores completion tokens only on a GPU, the same on both paths); attention's QK and AV
products four times too. TRL's pass: 64 rows of prompt + 1,024 tokens, causal attention counted as half the square
(flash attention skips the masked half). Packed: 8 x (1 - dead) rows of prompt + G x (1 + completion) tokens, the
block mask's attention counted as the whole square (sdpa's kernels with a mask skip nothing). Qwen3.5's Gated
DeltaNet layers count their projections only (their recurrence, linear in tokens, is left out: a few per cent).
"""

from __future__ import annotations

import argparse

from vision_grpo.plan import formulas as mf
from vision_grpo.plan.estimate import DEFAULT_IMAGE_PIXELS, model_config, parameter_counts

MODELS = ("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3.5-4B")
PROMPTS, G, LIMIT = 8, 8, 1024


def training_pass_flops(name: str, text: int, completion: int, dead: float) -> dict[str, float]:
    """FLOPs of one step's training pass, TRL's and packed, and the tokens each computes."""
    config = model_config(name)
    shape = mf.shape_of(config)
    counts = parameter_counts(config, 0, False, None)
    language = counts["total"] - counts["vision"] - 2 * shape.vocab * shape.hidden  # embeddings and head aside
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        language += shape.vocab * shape.hidden
    prompt = text + mf.image_tokens(shape, DEFAULT_IMAGE_PIXELS)[1]
    attention = sum(t == "full_attention" for t in shape.layer_types) * 2 * 2 * shape.heads * shape.head_dim

    def flops(rows: float, length: int, causal_half: bool) -> float:
        square = length**2 / 2 if causal_half else length**2
        return 4 * rows * (2 * language * length + attention * square)

    packed_length = prompt + G * (1 + completion)
    trl = flops(PROMPTS * G, prompt + LIMIT, True)
    packed = flops(PROMPTS * (1 - dead), packed_length, False)
    return {
        "prompt": prompt,
        "tokens_trl": PROMPTS * G * (prompt + LIMIT),
        "tokens_packed": PROMPTS * (1 - dead) * packed_length,
        "pflop_trl": trl / 1e15,
        "pflop_packed": packed / 1e15,
        "ratio": trl / packed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completion", type=int, default=279, help="mean completion tokens (the seed's: 279)")
    parser.add_argument("--dead", type=float, default=0.0, help="share of groups whose rewards are all equal")
    parser.add_argument("--text", type=int, default=256, help="prompt text tokens besides the image's")
    args = parser.parse_args()
    for name in MODELS:
        e = training_pass_flops(name, args.text, args.completion, args.dead)
        print(
            f"{name}: prompt {e['prompt']} tokens; training pass {e['pflop_trl']:.1f} PFLOP on TRL's "
            f"({e['tokens_trl']:,} tokens), {e['pflop_packed']:.1f} packed ({e['tokens_packed']:,.0f}): "
            f"{e['ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
