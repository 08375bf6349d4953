"""GPU check at real size: Qwen2.5-VL-3B and Qwen3.5-4B with random weights (nothing downloaded), the GeoQA evaluation
and one GRPO step of the seed's recipe, through our own entry points.

    python benchmarks/gpu_check.py [--workdir /tmp/gpu-check] [--eval-items 100] [--max-new-tokens 1024]
    python benchmarks/gpu_check.py --dry-run        # any machine: the two configurations' parameter counts
    python benchmarks/gpu_check.py --toy            # any machine, minutes on a CPU: the same stages at replica size

Each model is the embedded replica (`vision-grpo/tiny-qwen2.5-vl`, `vision-grpo/tiny-qwen3.5`: tokenizer, chat
template, processor, config) with the published dimensions put into its config (below) and random bf16 weights
made on the GPU; the processor keeps the family's real pixel limits. Stages, each in its own process so GPU-memory
figures do not mix:
1. `eval/evaluate.py` with the model's GeoQA recipe on the fixed 100-question subset of the GeoQA-schema fixture,
   `--max_new_tokens` 1,024 (the seed's), batched: samples/s (the seed's service measured 2.20), peak GPU memory.
2. `recipes/train.py` with the seed's recipe (`recipes/geoqa/qwen3_5_4b_lora.yaml`: 8 questions x 8 completions of
   up to 1,024 tokens, LoRA r32, gradient checkpointing) for one step: s/step (TRL's `step_time`), peak GPU memory;
   then the same step with `--share_prompt_copies false` (every copy encoded and prefilled): the ratios of the two
   are what sharing the copies gives on a GPU (benchmarks/vision_once.py measures it on a CPU).
A random-weight model never stops before the length limit: every completion is full length, the worst case.

The GPU machine has CUDA torch, accelerate and an older transformers, but no trl or datasets and no registry. Where
pip works, download the wheels it lacks (about 16 MB; Python 3.12, manylinux x86-64), carry `.whl`, install there:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        trl==1.16.0 datasets==5.2.0 transformers==5.24.0 peft==0.21.2 dill==0.4.1 multiprocess==0.70.19
    # on the GPU machine, in the repository root (vision_grpo maps data/, rewards/, eval/: install it editable):
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 && python3 -m pip install -q --no-index --no-deps \
        --no-build-isolation -e . && python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json

Those seven wheels are 16.5 MB (docs/performance.md); their other needs are on the GPU machine as its package list
reads (huggingface_hub 1.33 satisfies transformers and datasets; huggingface_hub 2.x would need httpx2), except
that datasets 5.2 needs pyarrow >= 24: see `pip show pyarrow` there and carry its wheel (~45 MB) if older.
Budget: about 3 minutes for the evaluations and 2-4 for the training step on an H200 (estimates, not measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import REPO, markdown_table, read_step_log, report
from gpu_qwen2_5_vl_3b import MAX_PIXELS, MIN_PIXELS, TEXT_CONFIG, VISION_CONFIG

from vision_grpo.models.gated_deltanet import describe_gated_deltanet_path, gated_deltanet_path

SEED_RECIPE = "recipes/geoqa/qwen3_5_4b_lora.yaml"
# Qwen3.5-4B at its published dimensions: hidden 2,560, 32 layers with full attention every 4th (the rest Gated
# DeltaNet), 16 query / 4 key-value heads of 256, vocabulary 248,320, tied embeddings, mrope [11, 11, 10] over a
# quarter of each head; the MLP width and the linear-attention heads are those of the copies of its config.json we
# could read (not the Hub file itself), and give the 4.65 B parameters counted in the README.
QWEN3_5_4B_LAYERS = 32
QWEN3_5_4B_TEXT = {
    "vocab_size": 248320,
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": QWEN3_5_4B_LAYERS,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(QWEN3_5_4B_LAYERS)],
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
}
QWEN3_5_4B_VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "out_hidden_size": 2560,
    "num_position_embeddings": 2304,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
MODELS = {
    "qwen2.5-vl-3b": {
        "replica": "vision-grpo/tiny-qwen2.5-vl",
        "recipe": "recipes/geoqa/qwen2_5_vl_3b_lora.yaml",
        "text": {**TEXT_CONFIG, "layer_types": ["full_attention"] * TEXT_CONFIG["num_hidden_layers"]},
        "vision": VISION_CONFIG,
        "pixels": (MIN_PIXELS, MAX_PIXELS),
    },
    "qwen3.5-4b": {
        "replica": "vision-grpo/tiny-qwen3.5",
        "recipe": SEED_RECIPE,
        "text": QWEN3_5_4B_TEXT,
        "vision": QWEN3_5_4B_VISION,
        "pixels": (256 * 256, 4096 * 4096),  # Qwen3-VL's processor defaults (its shortest/longest edge in pixels)
    },
}
EVAL_COLUMNS = ("items", "batch", "samples_per_s", "mean_completion_tokens", "peak_gpu_gib")
# On a CPU (--toy) the recipes' GPU settings give way to what a CPU allows.
CPU_OVERRIDES = ["--dtype", "float32", "--bf16", "false", "--use_cpu", "true", "--activation_checkpointing", "false"]


def real_config(name: str, toy: bool) -> Any:
    """The replica's config; at real size with the published dimensions put in (its token ids stay the replica's)."""
    from transformers import AutoConfig

    from vision_grpo.models.embedded import resolve_model_path

    spec = MODELS[name]
    config = AutoConfig.from_pretrained(resolve_model_path(spec["replica"]))
    if not toy:
        config.text_config.update(spec["text"])
        config.vision_config.update(spec["vision"])
    return config


def parameter_count(name: str) -> int:
    """Parameters at real size, counted on the meta device (no memory, any machine)."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = real_config(name, toy=False)  # builds the replica on first use: not on the meta device
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build(name: str, target: Path, toy: bool) -> Path:
    """The replica's folder with random weights of the (real-size) config, made on the GPU when there is one."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vision_grpo.models.embedded import resolve_model_path

    if (target / "config.json").exists():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(resolve_model_path(MODELS[name]["replica"]), staging)  # tokenizer, template, processor
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    config = real_config(name, toy)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.save_pretrained(staging)
    staging.rename(target)
    return target


def common_args(name: str, model_dir: Path, fixture: Path, toy: bool) -> list[str]:
    """Recipe overrides both stages share: the built model, the fixture, and the pixel limits or the CPU settings."""
    args = ["--model_name_or_path", str(model_dir), "--dataset_name", str(fixture)]
    if toy:
        return args + CPU_OVERRIDES
    low, high = MODELS[name]["pixels"]
    return args + ["--min_pixels", str(low), "--max_pixels", str(high)]


def gpu_peak() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def stage_eval(recipe: str, args: list[str], output: str, batch: int, items: int, tokens: int) -> dict[str, Any]:
    """In this process: the evaluator on the first `items` questions of the fixed subset."""
    from vision_grpo.evaluation import evaluate

    argv = ["--config", recipe, *args, "--output", output, "--batch_size", str(batch), "--limit", str(items)]
    result = evaluate.main([*argv, "--max_new_tokens", str(tokens)])
    summary = result["summary"]
    return {
        "items": summary["n"],
        "batch": batch,
        "samples_per_s": summary["samples_per_s"],
        "mean_completion_tokens": summary["mean_completion_tokens"],
        "hit_limit_rate": summary["hit_limit_rate"],
        "dtype": result["metadata"]["dtype"],
        "device": result["metadata"]["device"],
        "peak_gpu_gib": gpu_peak(),
    }


def stage_train(args: list[str], workdir: str, toy: bool) -> dict[str, Any]:
    """In this process: one GRPO step of the seed's recipe through `recipes/train.py`; TRL's `step_time`."""
    import runpy

    argv = ["--config", SEED_RECIPE, *args, "--output_dir", workdir, "--run_name", "check", "--max_steps", "1"]
    argv += ["--save_strategy", "no", "--logging_steps", "1", "--report_to", "tensorboard"]
    argv += ["--token_check_samples", "8"]
    if toy:  # one micro-batch of 8 completions of 8 tokens
        argv += ["--gradient_accumulation_steps", "1", "--max_completion_length", "8"]
    start = time.perf_counter()
    runpy.run_path(str(REPO / "recipes" / "train.py"))["main"](argv)
    log = read_step_log(Path(workdir) / "check")
    return {"s_per_step": log.step_times[0], "stage_wall_s": time.perf_counter() - start, "peak_gpu_gib": gpu_peak()}


def in_child(stage: str, arguments: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one stage in a fresh process; its figures come back on its last `STAGE` line."""
    command = [sys.executable, __file__, "--stage", stage, "--stage-args", json.dumps(arguments)]
    process = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=os.environ)
    if process.returncode != 0:
        raise RuntimeError(f"stage {stage} failed ({process.returncode}):\n{process.stderr[-6000:]}")
    line = [line for line in process.stdout.splitlines() if line.startswith("STAGE ")][-1]
    return json.loads(line[len("STAGE ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/vision-grpo-gpu-check", help="weights (~17 GB), runs, results")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--eval-items", type=int, default=100)
    parser.add_argument("--eval-batch", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--no-train", action="store_true", help="skip the GRPO step")
    parser.add_argument("--toy", action="store_true", help="replica size on any machine: a smoke test of the stages")
    parser.add_argument("--dry-run", action="store_true", help="print the configurations' parameter counts only")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--stage-args", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.stage:
        call = {"eval": stage_eval, "train": stage_train}[args.stage]
        print("STAGE " + json.dumps(call(**json.loads(args.stage_args))), flush=True)
        return
    figures: dict[str, Any] = {name: {"parameters": parameter_count(name)} for name in args.models}
    for name in args.models:
        print(f"{name}: {figures[name]['parameters'] / 1e9:.2f} B parameters at the published dimensions")
    if "qwen3.5-4b" in figures:  # which Gated DeltaNet implementation this machine's run takes (kernels or torch)
        figures["qwen3.5-4b"]["gated_deltanet_path"] = gated_deltanet_path()
        print(describe_gated_deltanet_path(figures["qwen3.5-4b"]["gated_deltanet_path"]))
    if args.dry_run:
        report("gpu_check", figures, args.json)
        return

    import torch

    from vision_grpo.data.geoqa_fixture import write_fixture

    if not (args.toy or torch.cuda.is_available()):
        sys.exit("no CUDA GPU: use --toy for a smoke test at replica size, or --dry-run")
    figures["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    fixture = workdir / "geoqa_fixture.parquet"
    if not fixture.exists():
        write_fixture(fixture, train_rows=16)
    for name in args.models:
        model_dir = build(name, workdir / (f"{name}-toy" if args.toy else name), args.toy)
        shared = common_args(name, model_dir, fixture, args.toy)
        evaluation = {"recipe": MODELS[name]["recipe"], "args": shared, "output": str(workdir / f"{name}.json")}
        evaluation.update(batch=args.eval_batch, items=args.eval_items, tokens=args.max_new_tokens)
        figures[name]["eval"] = in_child("eval", evaluation, timeout=1800)
        if name == "qwen3.5-4b" and not args.no_train:
            for key, copies in (("train", []), ("train_per_copy", ["--share_prompt_copies", "false"])):
                train = {"args": [*shared, *copies], "workdir": str(workdir / key), "toy": args.toy}
                figures[name][key] = in_child("train", train, timeout=1800)

    where = figures["gpu"] or "CPU (toy size)"
    print(f"\nGeoQA evaluation, {args.eval_items} fixture items, {args.max_new_tokens} new tokens, on {where}")
    rows = [[name, *(figures[name]["eval"][key] for key in EVAL_COLUMNS)] for name in args.models]
    print(markdown_table(["model", *EVAL_COLUMNS], rows))
    if "train" in figures.get("qwen3.5-4b", {}):
        train, per_copy = figures["qwen3.5-4b"]["train"], figures["qwen3.5-4b"]["train_per_copy"]
        print(f"one GRPO step of {SEED_RECIPE}: {train['s_per_step']:.1f} s, peak GPU {train['peak_gpu_gib']} GiB")
        print(
            f"  every copy encoded and prefilled: {per_copy['s_per_step']:.1f} s, peak GPU {per_copy['peak_gpu_gib']} "
            f"GiB; step time per-copy / shared {per_copy['s_per_step'] / train['s_per_step']:.2f}x"
        )
    report("gpu_check", figures, args.json)


if __name__ == "__main__":
    main()
