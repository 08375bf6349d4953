"""Each prompt's image encoded once (vision_grpo/models/shared_vision.py) against the per-copy path, at 1 MP, G = 8.

    python benchmarks/vision_once.py [--quick] [--json FILE]

The model is Qwen2.5-VL's architecture (window-attention tower with its full-attention blocks, 2x2 merger, mrope
language model) with the real 3B model's depths (32 vision blocks, 36 layers) and every width divided by 16, so the
tower keeps its share of the parameters (tower : language model, embeddings aside, 0.21 here and in the 3B model) and
of the per-token FLOPs; attention, which shrinks with one width instead of two, weighs relatively more here than on
the real model. Vocabulary: the embedded replica's tokenizer.

One GRPO step as TRL runs it with beta = 0 and one iteration: HF generation of G completions per prompt, then the
policy's forward and backward over prompt and completion with gradient checkpointing, as the recipes train (fixed
completion tokens, so both paths train on the same sequences). Frozen tower: the recipes' default, where the shared
path also reuses the generation's features in the training pass; trainable tower: features shared within each
forward only. Each variant runs in its own process (peak RSS is per process), per-copy and shared interleaved; the
ratios are of the medians. The shared path is the trainer's: the vision tower shared and, in generation, each
prompt prefilled once (vision_grpo/models/shared_prefill.py).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import child_figures, report, scaled_config
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.models.processing import load_processor
from vision_grpo.models.shared_prefill import share_prefill
from vision_grpo.models.shared_vision import share_vision_tower
from vision_grpo.models.vision import vision_special_token_ids

SIDE = (1008, 1008)  # 1.02 MP: 72 x 72 patches of 14 px, 1296 image tokens after the 2x2 merge
QUICK_SIDE = (224, 224)
COPIES = 8  # G
COMPLETION = 32  # completion tokens per copy


def scaled_model() -> tuple[torch.nn.Module, Any]:
    """Qwen2.5-VL-3B's depths with its widths / 16 (see the module docstring), seeded, and the replica's processor."""
    path = resolve_model_path("vision-grpo/tiny-qwen2.5-vl")
    processor = load_processor(path, min_pixels=3136, max_pixels=SIDE[0] * SIDE[1])
    config = scaled_config("Qwen--Qwen2.5-VL-3B-Instruct", "vision-grpo/tiny-qwen2.5-vl", width=16, depth=1)
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval(), processor


def inputs(processor: Any, side: tuple[int, int]) -> dict[str, torch.Tensor]:
    """G copies of one prompt with one photograph-like image, as TRL's repeated prompts give them."""
    generator = torch.Generator().manual_seed(1)
    image = Image.fromarray((torch.rand(side[1], side[0], 3, generator=generator) * 255).byte().numpy())
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]}],
        add_generation_prompt=True,
    )
    return processor(text=[text] * COPIES, images=[image] * COPIES, return_tensors="pt", padding=True)


def step(variant: str, tower: str, side: tuple[int, int], save: Path | None) -> dict[str, Any]:
    """One GRPO step in this process: generation, then the policy's forward and backward; times and peak RSS."""
    model, processor = scaled_model()
    model.model.visual.requires_grad_(tower == "trainable")
    model.gradient_checkpointing_enable()  # as the recipes train (`gradient_checkpointing: true`)
    batch = inputs(processor, side)
    shared = share_vision_tower(model)[0] if variant == "shared" else None
    if variant == "shared":
        share_prefill(model)  # as the trainer installs both for HF generation
    # Patches the tower's first layer embedded, under either path: what was really encoded, in images.
    patches = []
    model.model.visual.patch_embed.register_forward_pre_hook(lambda _, args: patches.append(args[0].shape[0]))
    if shared is not None and shared.cache is not None:
        shared.cache.active = True  # what the trainer's StepScopedFeatures does at the start of a step
    generator = torch.Generator().manual_seed(2)
    completion = torch.randint(0, 200, (COPIES, COMPLETION), generator=generator)
    special = torch.tensor(vision_special_token_ids(processor.tokenizer))
    completion[torch.isin(completion, special)] = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=COMPLETION, min_new_tokens=COMPLETION, do_sample=True)
    generated = time.perf_counter()
    sequences = {
        **batch,
        "input_ids": torch.cat([batch["input_ids"], completion], 1),
        "attention_mask": torch.cat([batch["attention_mask"], torch.ones_like(completion)], 1),
        "mm_token_type_ids": torch.cat([batch["mm_token_type_ids"], torch.zeros_like(completion)], 1),
    }
    logits = model(**sequences, logits_to_keep=COMPLETION + 1).logits[:, :-1]  # as TRL: the completion's only
    log_probs = logits.log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)
    (-log_probs.mean()).backward()
    end = time.perf_counter()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if save is not None:
        gradients = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        torch.save({"log_probs": log_probs.detach(), "gradients": gradients}, save)
    return {
        "generation_s": generated - start,
        "step_s": end - start,
        "peak_mib": (peak_kib - rss_before) / 1024,
        "tower_images_per_distinct": sum(patches) / int(batch["image_grid_thw"][0].prod()),  # one distinct image
    }


def max_differences(per_copy: Path, shared: Path) -> tuple[float, float]:
    a, b = torch.load(per_copy), torch.load(shared)
    log_probs = (a["log_probs"] - b["log_probs"]).abs().max().item()
    assert a["gradients"].keys() == b["gradients"].keys()
    gradients = max((a["gradients"][k] - b["gradients"][k]).abs().max().item() for k in a["gradients"])
    return log_probs, gradients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="224-px images, one run each (figures mean little)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    side = QUICK_SIDE if args.quick else SIDE
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        saved = {variant: Path(tmp) / f"{variant}.pt" for variant in ("per-copy", "shared")}
        for repeat in range(1 if args.quick else 2):
            for tower in ("frozen", "trainable"):
                for variant in ("per-copy", "shared"):
                    save = saved[variant] if tower == "trainable" and repeat == 0 else None
                    measured = child_figures(step, variant, tower, side, save, what=f"{variant}/{tower}")
                    runs.setdefault((variant, tower), []).append(measured)
                    print(f"  {variant:8s} {tower:9s} {runs[variant, tower][-1]}", file=sys.stderr, flush=True)
        log_prob_diff, gradient_diff = max_differences(saved["per-copy"], saved["shared"])

    def median(variant: str, tower: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[variant, tower])

    def ratio(tower: str, key: str) -> float:
        return median("per-copy", tower, key) / median("shared", tower, key)

    figures = {
        "image_pixels": side[0] * side[1],
        "copies": COPIES,
        "tower_calls_shared": median("shared", "frozen", "tower_images_per_distinct"),
        "tower_calls_per_copy": median("per-copy", "frozen", "tower_images_per_distinct"),
        "step_ratio_frozen": ratio("frozen", "step_s"),
        "step_ratio_trainable": ratio("trainable", "step_s"),
        "generation_ratio": ratio("frozen", "generation_s"),
        "peak_memory_ratio": ratio("frozen", "peak_mib"),
        "max_log_prob_difference": log_prob_diff,
        "max_gradient_difference": gradient_diff,
        "runs": {f"{variant}/{tower}": values for (variant, tower), values in runs.items()},
    }
    print(
        "vision tower calls per distinct image per step: "
        f"shared {figures['tower_calls_shared']:.0f}, per-copy {figures['tower_calls_per_copy']:.0f}"
    )
    print(f"step time per-copy / shared: {figures['step_ratio_frozen']:.2f}x (frozen vision tower)")
    print(f"step time per-copy / shared: {figures['step_ratio_trainable']:.2f}x (trainable vision tower)")
    print(f"generation time per-copy / shared: {figures['generation_ratio']:.2f}x")
    print(f"peak memory per-copy / shared: {figures['peak_memory_ratio']:.2f}x")
    print(f"max |log-prob difference|: {log_prob_diff:.3g}; max |gradient difference|: {gradient_diff:.3g}")
    report("vision_once", figures, args.json)


if __name__ == "__main__":
    main()
