"""The memory plan's formulas (vision_grpo/plan/formulas.py) against what the code keeps, per part, on CPU.

    python benchmarks/memory_plan.py [--quick] [--json FILE]

Each family's shipped config (vision_grpo/plan/model_configs/) at its real hidden size, heads, vocabulary and vision
width, with 1 or 2 decoder layers (and vision blocks), LoRA r=32 as the GeoQA recipes, bf16 autocast as training.
The models run on fake tensors (torch's FakeTensorMode): every op of transformers, PEFT and TRL runs with its real
shapes, dtypes and CPU autocast rules but no data, so real sizes (a 248k vocabulary, thousands of tokens) cost
seconds on a CPU whose bfloat16 matmuls are far too slow for them. Measured per part:
- kept for backward: each storage autograd saves (saved-tensor hooks), once, weights left out, attributed to a
  decoder layer, the vision tower or the LM head by module hooks; the slope between 1 and 2 layers is the
  per-layer cost the plan multiplies by the layer count;
- peaks: the bytes of live storages (a dispatch mode that sees every allocation and every free) over the LM head's
  forward and backward, over the language model's generation prefill (at two sizes), over the vision tower's
  forward without gradient, and over the whole model's prefill of a prompt with an image (real tensors at 1/8 of
  the width: the vision tower reads its grid's values), one image size per side of the plan's maximum;
- the generation cache: the bytes of the cache after a prefill and decoding steps.
One check runs the same decoder-layer count on real tensors at a small size: fake and real must agree exactly,
which is what makes the fake counts measurements. `--quick` runs smaller sizes, the vision tower of one family
and one narrow real-tensor check.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Its folder (for `common`) and the repository: also when run by runpy, which puts neither on the path
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import markdown_table, report  # noqa: E402
from fake_models import FAMILIES, RANK, MiB  # noqa: E402
from memory_rows import (  # noqa: E402
    generation_rows,
    head_rows,
    image_prefill_row,
    layer_rows,
    real_check,
    vision_prefill_row,
    vision_rows,
)


def ratio(measured: float, planned: float) -> str:
    return f"{measured / planned:.2f}" if planned else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and a narrow real-tensor check")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    # Full: a GeoQA micro-batch, 8 x (about 300 prompt + 1,024 completion) tokens, and TRL's 64 sequences generated
    batch, length, steps = (1, 256, 4) if args.quick else (8, 1324, 16)
    # Generation: TRL's 64 sequences from a 300-token prompt, and from a GeoQA prompt with a capped image (Qwen3)
    gen_sizes = [(2, 128), (4, 512)] if args.quick else [(64, 300), (64, 1217)]
    side = 112 if args.quick else 224  # real tensors: bfloat16 matmuls on CPU limit the image
    figures: dict[str, Any] = {"quick": args.quick, "families": {}}
    rows: list[list[Any]] = []
    for family in FAMILIES:
        types = ["linear_attention"] if family == "Qwen3.5-4B" else ["full_attention"]
        found: dict[str, Any] = {}
        print(f"({family}: {time.perf_counter() - start:.0f} s, layer_rows)", file=sys.stderr, flush=True)
        one, two = layer_rows(family, types, batch, length), layer_rows(family, types * 2, batch, length)
        found["layers"] = {"1": one, "2": two}
        slope = two[-1]["measured"] - one[-1]["measured"]
        for row in two[:-1]:
            rows.append(
                [
                    family,
                    f"decoder layer {row['layer']} ({row['type']}), kept",
                    row["plan"] / MiB,
                    row["measured"] / MiB,
                    ratio(row["measured"], row["plan"]),
                ]
            )
        if family == "Qwen3.5-4B":
            mixed = layer_rows(family, ["linear_attention", "full_attention"], batch, length)
            found["layers"]["linear+full"] = mixed
            rows.append(
                [
                    family,
                    "decoder layer 1 (full_attention), kept",
                    mixed[1]["plan"] / MiB,
                    mixed[1]["measured"] / MiB,
                    ratio(mixed[1]["measured"], mixed[1]["plan"]),
                ]
            )
        planned_slope = two[-1]["plan"] - one[-1]["plan"]
        rows.append(
            [
                family,
                "2 layers minus 1 layer (whole backbone)",
                planned_slope / MiB,
                slope / MiB,
                ratio(slope, planned_slope),
            ]
        )
        print(f"({family}: {time.perf_counter() - start:.0f} s, head_rows)", file=sys.stderr, flush=True)
        head = head_rows(family, batch * (length - 1))
        found["head"] = head
        rows.append(
            [
                family,
                "LM head, kept",
                head["kept_plan"] / MiB,
                head["kept_measured"] / MiB,
                ratio(head["kept_measured"], head["kept_plan"]),
            ]
        )
        rows.append(
            [
                family,
                "LM head, peak (CPU torch fallback; plan: CUDA)",
                head["peak_plan"] / MiB,
                head["peak_measured"] / MiB,
                ratio(head["peak_measured"], head["peak_plan"]),
            ]
        )
        print(f"({family}: {time.perf_counter() - start:.0f} s, generation_rows)", file=sys.stderr, flush=True)
        # Qwen3.5's Gated DeltaNet layer sets its prefill peak: put it last, as in a deep model (the layer input is
        # then not the embeddings, and autocast's bf16 copies of every layer's adapters are alive)
        gen_layers = types * 2 if family != "Qwen3.5-4B" else ["full_attention", "linear_attention"]
        found["generation"] = {}
        for gen_batch, prompt in gen_sizes:
            gen = generation_rows(family, gen_layers, gen_batch, prompt, steps)
            found["generation"][f"{gen_batch}x{prompt}"] = gen
            if prompt == gen_sizes[0][1]:
                rows.append(
                    [
                        family,
                        "generation cache (2 layers)",
                        gen["cache_plan"] / MiB,
                        gen["cache_measured"] / MiB,
                        ratio(gen["cache_measured"], gen["cache_plan"]),
                    ]
                )
            rows.append(
                [
                    family,
                    f"generation prefill peak (2 layers, {gen_batch} x {prompt} tokens)",
                    gen["prefill_peak_plan"] / MiB,
                    gen["prefill_peak_measured"] / MiB,
                    ratio(gen["prefill_peak_measured"], gen["prefill_peak_plan"]),
                ]
            )
        print(f"({family}: {time.perf_counter() - start:.0f} s, image_prefill_row)", file=sys.stderr, flush=True)
        found["image_prefill"] = {}
        for image_side in (224, 448):  # the language model's peak with the image alive; the vision tower's
            whole = image_prefill_row(family, image_side)
            found["image_prefill"][str(image_side)] = whole
            rows.append(
                [
                    family,
                    f"whole-model prefill, {whole['prompt']} tokens with a {image_side}px image (1/8 width, real "
                    f"tensors), peak in the {whole['peak_in']}",
                    whole["plan"] / MiB,
                    whole["measured"] / MiB,
                    ratio(whole["measured"], whole["plan"]),
                ]
            )
        print(f"({family}: {time.perf_counter() - start:.0f} s, vision_rows)", file=sys.stderr, flush=True)
        if args.quick and family != "Qwen2.5-VL-3B":
            figures["families"][family] = found
            continue
        vision = vision_rows(family, side)
        found["vision"] = vision
        rows.append(
            [
                family,
                f"vision block with LoRA ({vision['patches']} patches), 2 minus 1 block",
                vision["block_plan"] / MiB,
                vision["slope_measured"] / MiB,
                ratio(vision["slope_measured"], vision["block_plan"]),
            ]
        )
        encode = vision_prefill_row(family, side)
        found["vision_prefill"] = encode
        rows.append(
            [
                family,
                f"vision tower without gradient ({encode['patches']} patches), peak",
                encode["plan"] / MiB,
                encode["measured"] / MiB,
                ratio(encode["measured"], encode["plan"]),
            ]
        )
        figures["families"][family] = found
        print(f"({family}: {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    check_length = 64
    figures["real_check"] = {
        family: real_check(family, t, check_length, narrow=args.quick)
        for family, t in (("Qwen2.5-VL-3B", "full_attention"), ("Qwen3.5-4B", "linear_attention"))
        if family == "Qwen3.5-4B" or not args.quick
    }
    print(
        f"sizes: micro-batch {batch} x {length} tokens, {side}x{side} image (vision, real tensors), "
        f"generation {gen_sizes} (sequences, prompt), LoRA r={RANK}, bf16 autocast, fake tensors"
    )
    print(markdown_table(["family", "part", "plan MiB", "measured MiB", "measured / plan"], rows))
    width = "1/8 width" if args.quick else "real width"
    for family, counts in figures["real_check"].items():
        print(
            f"fake vs real tensors, {family} one layer ({width}, {check_length} tokens): "
            f"{counts['fake']:,} vs {counts['real']:,} bytes kept"
        )
    figures["rows"] = rows
    figures["seconds"] = time.perf_counter() - start
    report("memory_plan", figures, args.json)


if __name__ == "__main__":
    main()
