"""GPU benchmark at real size: Qwen2.5-VL-3B's dimensions with random weights, so nothing is downloaded.

    python benchmarks/gpu_qwen2_5_vl_3b.py [--workdir /tmp/qwen3b] [--steps 4] [--eval-items 100]
    python benchmarks/gpu_qwen2_5_vl_3b.py --dry-run     # any machine: the config and its parameter count only

Needs one CUDA GPU with about 40 GB free (more with vLLM), ~8 GB of disk for the weights; never part of CI.
1. Build: the config below (Qwen2.5-VL-3B-Instruct's text and vision dimensions, its 151,936-token vocabulary),
   random bf16 weights created on the GPU, the tiny model's tokenizer (its ids all lie inside the vocabulary;
   ids it does not know decode to nothing) and Qwen2.5-VL's default pixel limits; saved to `--workdir`.
2. GRPO: `recipes/train.py` with `recipes/shapes/qwen2_5_vl_3b_lora.yaml` (8 prompts x 8 generations per step,
   256-token completions, LoRA r32 on language model and vision tower, gradient checkpointing), model path
   overridden; median s/step after the first step, peak GPU memory, peak host memory.
3. The same with generation in vLLM, colocated (`..._vllm_colocate.yaml`), if vLLM is importable.
4. Evaluator samples/s on `--eval-items` held-out questions, batched (`--eval-batch`) and a few one at a time.
A random-weight model never stops before the length limit: every rollout and answer is full length, the
worst case for time and memory. Each stage runs in its own process, so GPU memory figures do not mix.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from common import REPO, check, markdown_table, median, read_step_log, report, run_measured

RECIPE = REPO / "recipes" / "shapes" / "qwen2_5_vl_3b_lora.yaml"
VLLM_RECIPE = REPO / "recipes" / "shapes" / "qwen2_5_vl_3b_lora_vllm_colocate.yaml"
# Qwen2.5-VL-3B-Instruct's config.json (transformers 5 layout); token ids are filled in from the tokenizer.
TEXT_CONFIG = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    "tie_word_embeddings": True,
}
VISION_CONFIG = {
    "depth": 32,
    "hidden_act": "silu",
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_chans": 3,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
}
# Qwen2.5-VL's processor defaults: 4 to 16,384 image tokens of 28 x 28 pixels.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384


def qwen2_5_vl_3b_config(tokenizer: Any) -> Any:
    """The 3B model's configuration with the special-token ids of `tokenizer`."""
    from transformers import Qwen2_5_VLConfig

    ids = tokenizer.convert_tokens_to_ids
    special = {
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    return Qwen2_5_VLConfig(
        text_config={**TEXT_CONFIG, **special},
        vision_config=VISION_CONFIG,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def parameter_count() -> int:
    """Parameters of the 3B configuration, counted on the meta device (no memory, any machine)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from vision_grpo.models.replicas.build import build_tokenizer
    from vision_grpo.models.replicas.families import FAMILIES

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_3b_config(build_tokenizer(FAMILIES["qwen2.5-vl"])))
    return sum(p.numel() for p in model.parameters())


def build(target: Path) -> Path:
    """Random bf16 weights of the 3B configuration, made on the GPU and saved with tokenizer and processor."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from vision_grpo.models.replicas.build import build_processor, build_tokenizer
    from vision_grpo.models.replicas.families import FAMILIES

    if (target / "config.json").exists():
        return target
    family = FAMILIES["qwen2.5-vl"]
    tokenizer = build_tokenizer(family)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_3b_config(tokenizer)).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    build_processor(family, tokenizer, MIN_PIXELS, MAX_PIXELS).save_pretrained(target)
    return target


def stage_train(model_dir: str, recipe: str, steps: int, workdir: str) -> dict[str, Any]:
    """In this process: GRPO steps through our entry point; s/step from its TensorBoard events, peak GPU memory."""
    import runpy

    import torch

    argv = ["--config", recipe, "--model_name_or_path", model_dir, "--output_dir", workdir, "--run_name", "bench"]
    argv += ["--max_steps", str(steps), "--save_strategy", "no", "--logging_steps", "1", "--shapes_train_size", "64"]
    runpy.run_path(str(REPO / "recipes" / "train.py"))["main"](argv)
    log = read_step_log(Path(workdir))
    return {
        "s_per_step": median(log.step_periods()),
        "first_step_s": log.step_times[0],
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }


def stage_eval(model_dir: str, items: int, batch: int, single: int, workdir: str) -> dict[str, Any]:
    """In this process: the evaluator batched on `items` questions and one at a time on the first `single`."""
    import torch
    from trl import GRPOConfig, ModelConfig

    from vision_grpo.data import get_dataset
    from vision_grpo.evaluation.backends import build_evaluator
    from vision_grpo.evaluation.eval_options import EvalArguments
    from vision_grpo.evaluation.evaluate import run_evaluation
    from vision_grpo.models.loading import max_pixels_of
    from vision_grpo.recipe.arguments import TaskArguments
    from vision_grpo.recipe.parse import parse_recipe

    argv = ["--config", str(RECIPE), "--model_name_or_path", model_dir, "--shapes_eval_size", str(items)]
    task, train, model_args, eval_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig, EvalArguments), argv)
    evaluator = build_evaluator(task, train, model_args, eval_args)[0]
    evaluator.model.to("cuda")  # build_evaluator leaves the model where from_pretrained put it (the CPU)
    dataset = get_dataset(task, "eval", max_pixels_of(evaluator.processor))
    figures: dict[str, Any] = {}
    eval_args.output = f"{workdir}/eval.json"
    eval_args.batch_size = batch
    run_evaluation(evaluator, dataset.select(range(min(batch, items))), eval_args, 8, {})  # warm-up, untimed
    for name, size, rows in (("batched", batch, items), ("one at a time", 1, min(single, items))):
        eval_args.batch_size = size
        summary = run_evaluation(evaluator, dataset.select(range(rows)), eval_args, train.max_completion_length, {})
        summary = summary["summary"]
        figures[name] = {"batch": size, "items": rows, "samples_per_s": summary["samples_per_s"]}
        figures[name]["mean_completion_tokens"] = summary["mean_completion_tokens"]
    figures["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return figures


def in_child(stage: str, arguments: list[str], timeout: float) -> dict[str, Any]:
    """Run one stage in a fresh process; its figures come back on its last `STAGE` line."""
    measured = check(run_measured([__file__, "--stage", stage, *arguments], timeout=timeout), stage)
    line = [line for line in measured.output.splitlines() if line.startswith("STAGE ")][-1]
    return {**json.loads(line[len("STAGE ") :]), "peak_rss_gib": measured.peak_rss_mib / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/vision-grpo-qwen3b", help="weights and runs (~8 GB)")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per generation back-end")
    parser.add_argument("--eval-items", type=int, default=100)
    parser.add_argument("--eval-batch", type=int, default=50)
    parser.add_argument("--eval-single", type=int, default=4, help="items evaluated one at a time")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: print the config's parameter count")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("stage_args", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    if args.stage:
        call = {"train": stage_train, "eval": stage_eval}[args.stage]
        typed = [int(a) if a.isdigit() else a for a in args.stage_args]
        print("STAGE " + json.dumps(call(*typed)), flush=True)
        return
    figures: dict[str, Any] = {"parameters": parameter_count()}
    print(f"Qwen2.5-VL-3B configuration: {figures['parameters'] / 1e9:.2f} B parameters")
    if args.dry_run:
        report("gpu_qwen2_5_vl_3b", figures, args.json)
        return

    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: this benchmark needs one (use --dry-run to check the configuration)")
    workdir = Path(args.workdir)
    model_dir = str(build(workdir / "model"))
    figures["gpu"] = torch.cuda.get_device_name(0)
    figures["hf_generate"] = in_child("train", [model_dir, str(RECIPE), str(args.steps), str(workdir / "hf")], 1800)
    try:
        import vllm  # noqa: F401

        vllm_run = [model_dir, str(VLLM_RECIPE), str(args.steps), str(workdir / "vllm")]
        figures["vllm_colocate"] = in_child("train", vllm_run, 1800)
    except ImportError:
        figures["vllm_colocate"] = None
    eval_run = [model_dir, str(args.eval_items), str(args.eval_batch), str(args.eval_single), str(workdir)]
    figures["evaluator"] = in_child("eval", eval_run, 1800)

    rows = [
        [name, result["s_per_step"], result["first_step_s"], result["peak_gpu_gib"], result["peak_rss_gib"]]
        for name, result in (("HF generate", figures["hf_generate"]), ("vLLM colocate", figures["vllm_colocate"]))
        if result
    ]
    print(f"\nGRPO on {figures['gpu']}, Qwen2.5-VL-3B dims (random weights), LoRA r32, 8x8 rollouts of 256 tokens")
    print(markdown_table(["generation", "s/step", "first step s", "peak GPU GiB", "peak host GiB"], rows))
    evaluator = figures["evaluator"]
    print(
        markdown_table(
            ["evaluator", "batch", "items", "samples/s", "tokens/answer"],
            [
                [name, e["batch"], e["items"], e["samples_per_s"], e["mean_completion_tokens"]]
                for name, e in evaluator.items()
                if isinstance(e, dict)
            ],
        )
    )
    report("gpu_qwen2_5_vl_3b", figures, args.json)


if __name__ == "__main__":
    main()
