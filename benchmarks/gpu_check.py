"""GPU check of what this round adds, at real size with random weights (nothing downloaded), in one command that
writes `gpu_check.json` and `gpu_check.md` (one table row per JSON entry) into `--out`:

    python benchmarks/gpu_check.py --out results/gpu_check                # one CUDA GPU, under 10 minutes
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check-dry     # any machine, about a minute on a CPU

What it measures, on the seed's recipe (`recipes/geoqa/qwen3_5_4b_lora.yaml`: Qwen3.5-4B, 8 questions x 8
completions of up to 1,024 tokens, LoRA r32, activation checkpointing) for one GRPO step through `recipes/train.py`:
1. Memory per phase (generation, the training forward+backward, the optimizer step, and the evaluation):
   `torch.cuda.max_memory_allocated` with `reset_peak_memory_stats` at each phase's start (benchmarks/
   gpu_check_parts.py), next to the memory plan's figure for that phase (vision_grpo/plan, `build_plan`'s parts, at
   the fixture's largest image) and their ratio.
2. Vision sharing: the same step with `--share_prompt_copies false`: step time and peak, per-copy / shared.
3. The training pass: the same step on TRL's pass (`--share_prompt_in_training false --balance_micro_batches
   false`): step time and peak, TRL's / packed. Every variant trains every row (`--skip_zero_advantage false`): a
   random-weight model scores every completion alike, and with the skip its training pass would run nothing.
4. vLLM vs HF: the same step with `--use_vllm true --vllm_mode colocate`, if vllm is importable (else recorded as
   skipped, with the reason).
5. GeoQA evaluation: `eval/evaluate.py` on the first `--eval-items` (100) questions of the fixed subset of the
   GeoQA-schema fixture, 1,024 new tokens (the seed's), HF and vLLM backends: samples/s next to the seed's 2.20
   ("Base 71.0% 75.0% 2.20 sample/s 48.65s": the seed's eval.py on its sampling service, 100 test questions,
   temperature 0.0, 1,024 max tokens, concurrent `sample_async()` calls).
A random-weight model never stops before the length limit: every completion is full length, the worst case. The
Gated DeltaNet path the run takes (kernels or torch) is in the JSON. `--models qwen2.5-vl-3b qwen3.5-4b` adds the
evaluation of random-weight Qwen2.5-VL-3B (outside the 10-minute estimate).

Time: each part runs in its own process under a cap, and the whole check under `--budget-s` (570): a part past its
cap, or with too little of the budget left, is killed or not started and recorded as skipped with the reason, so
the check ends inside the budget and still writes both files. Parts run most wanted first: build the weights (once,
kept in --workdir: random bf16 init on the GPU, 9.1 GB of safetensors), eval_hf, train_hf, train_hf_trl_pass,
train_vllm, eval_vllm, train_hf_per_copy; each part's cap (120-160 s) is in `EVAL_CAPS` and `TRAIN_PARTS`. The caps
come from estimates for one H200 (process start and load ~25 s, HF decoding ~30-35 ms a step at this size, vLLM's
engine start ~60 s, the training pass 3.2e15 FLOPs at an assumed 30% of 989 TFLOPS, doubled on the Gated DeltaNet
torch fallback), not from a measurement: they sum to ~620 s, so the last part is the one skipped unless the others
run faster.

Each model is the embedded replica (`vision-grpo/tiny-qwen3.5`, `vision-grpo/tiny-qwen2.5-vl`: tokenizer, chat
template, processor) in the published config (the memory plan's copy, vision_grpo/plan/model_configs/) with the
replica's token ids, random bf16 weights made on the GPU, the family's real pixel limits. `--dry-run` runs every
part at replica size on a CPU (float32, 4 new tokens, 8-token completions) through the same stage code; memory is
then not measured (`null`, no GPU), only the plan's figures and how often each phase ran; vLLM parts are skipped
without CUDA.

The GPU machine has CUDA torch, accelerate and an older transformers, but no trl or datasets and no registry. Where
pip works, download the wheels it lacks (about 16 MB; Python 3.12, manylinux x86-64), carry `.whl`, install there:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        trl==1.16.0 datasets==5.2.0 transformers==5.24.0 peft==0.21.2 dill==0.4.1 multiprocess==0.70.19
    # on the GPU machine, in the repository root (vision_grpo maps data/, rewards/, eval/: install it editable):
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 && python3 -m pip install -q --no-index --no-deps \\
        --no-build-isolation -e . && python3 benchmarks/gpu_check.py --out $OUT

Their other needs are on the GPU machine as its package list reads (huggingface_hub 1.33 satisfies transformers and
datasets), except that datasets 5.2 needs pyarrow >= 24: see `pip show pyarrow` there and carry its wheel if older.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from common import REPO, read_step_log, real_size_config
from gpu_check_parts import (
    EVAL_CAPS,
    STEP_PHASES,
    Budget,
    PhasePeaks,
    card_bytes,
    cuda,
    eval_entries,
    eval_plan_gib,
    phase_measured_trainer,
    run_part,
    step_entries,
    step_plan_phases,
    write_outputs,
)

from vision_grpo.models.gated_deltanet import describe_gated_deltanet_path, gated_deltanet_path

SEED_RECIPE = "recipes/geoqa/qwen3_5_4b_lora.yaml"
# name -> the replica that gives the tokenizer, template and processor; the published config (the memory plan's copy,
# vision_grpo/plan/model_configs/) that gives the dimensions; the recipe; the processor's pixel limits.
MODELS = {
    "qwen2.5-vl-3b": {
        "replica": "vision-grpo/tiny-qwen2.5-vl",
        "config": "Qwen--Qwen2.5-VL-3B-Instruct",
        "recipe": "recipes/geoqa/qwen2_5_vl_3b_lora.yaml",
        "pixels": (56 * 56, 28 * 28 * 16384),  # Qwen2.5-VL's processor defaults: 4 to 16,384 tokens of 28 x 28
    },
    "qwen3.5-4b": {
        "replica": "vision-grpo/tiny-qwen3.5",
        "config": "Qwen--Qwen3.5-4B",
        "recipe": SEED_RECIPE,
        "pixels": (256 * 256, 4096 * 4096),  # Qwen3-VL's processor defaults (its shortest/longest edge in pixels)
    },
}
# On a CPU (--dry-run) the recipes' GPU settings give way to what a CPU allows.
CPU_OVERRIDES = ["--dtype", "float32", "--bf16", "false", "--use_cpu", "true", "--activation_checkpointing", "false"]
VLLM_COLOCATE = ["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.3"]
VLLM_COLOCATE += ["--vllm_max_model_length", "2048"]  # prompt (~300 tokens at the fixture's images) + 1,024
# Random weights are no calibration of the logprob-gap guard (docs/evaluation.md): it warns here, never stops the step.
VLLM_COLOCATE += ["--logprob_gap_action", "warn"]
# The seed step's variants: name -> (recipe overrides, label, cap in seconds).
# A random-weight model earns one reward for every completion: every group would be left out of the training pass,
# which then measures nothing. Every variant trains every row.
EVERY_ROW = ["--skip_zero_advantage", "false"]
TRL_PASS = ["--share_prompt_in_training", "false", "--balance_micro_batches", "false"]
TRAIN_PARTS = {
    "train_hf": ([], "HF generation, copies shared", 130),
    "train_hf_trl_pass": (TRL_PASS, "HF generation, TRL's training pass (each row its prompt, padded)", 130),
    "train_vllm": (VLLM_COLOCATE, "vLLM colocate", 160),
    "train_hf_per_copy": (["--share_prompt_copies", "false"], "HF generation, every copy encoded and prefilled", 130),
}


def real_config(name: str, toy: bool) -> Any:
    """The replica's config; at real size the published one with the replica's token ids (`real_size_config`)."""
    from transformers import AutoConfig

    from vision_grpo.models.embedded import resolve_model_path

    spec = MODELS[name]
    if toy:
        return AutoConfig.from_pretrained(resolve_model_path(spec["replica"]))
    return real_size_config(spec["config"], spec["replica"])


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
    """Recipe overrides every stage shares: the built model, the fixture, and the pixel limits or the CPU settings."""
    args = ["--model_name_or_path", str(model_dir), "--dataset_name", str(fixture)]
    if toy:
        return args + CPU_OVERRIDES
    low, high = MODELS[name]["pixels"]
    return args + ["--min_pixels", str(low), "--max_pixels", str(high)]


def plan_pixels(name: str, fixture: Path) -> int:
    """Pixels per image for the plan: the fixture's largest image within the model's pixel limits (the plan would
    otherwise assume the recipe's cap, 1 MP, for the fixture's diagrams of at most 200 x 200)."""
    import io

    import pyarrow.parquet as pq
    from PIL import Image

    images = pq.read_table(fixture, columns=["image"]).column("image").to_pylist()
    sizes = [Image.open(io.BytesIO(image["bytes"])).size for image in images]
    largest = max(width * height for width, height in sizes)
    low, high = MODELS[name]["pixels"]
    return min(max(largest, low), high)


def stage_eval(
    recipe: str, args: list[str], output: str, batch: int, items: int, tokens: int, backend: str, pixels: int
) -> dict[str, Any]:
    """In this process: the evaluator on the first `items` questions of the fixed subset; with HF generation, this
    process's peak GPU memory beside the plan's figure for a generate call of `batch` prompts."""
    from vision_grpo.evaluation import evaluate
    from vision_grpo.plan.check import recipe_plan

    plan = None
    if backend == "hf":  # vLLM's engine runs in a process of its own, out of sight of this process's counter
        sizes = ["--per_device_train_batch_size", str(batch), "--num_generations", str(batch)]
        sizes += ["--gradient_accumulation_steps", "1", "--steps_per_generation", "1", "--share_prompt_copies", "false"]
        sizes += ["--max_completion_length", str(tokens), "--image_pixels", str(pixels)]
        plan = eval_plan_gib(recipe_plan(["--config", recipe, *args, *sizes])[0])
    argv = ["--config", recipe, *args, "--output", output, "--overwrite", "true", "--batch_size", str(batch)]
    argv += ["--limit", str(items)]
    peaks = PhasePeaks()
    peaks.begin()
    result = evaluate.main([*argv, "--max_new_tokens", str(tokens), "--backend", backend])
    peaks.end("evaluation")
    summary = result["summary"]
    return {
        "items": summary["n"],
        "batch": batch,
        "backend": backend,
        "samples_per_s": summary["samples_per_s"],
        "mean_completion_tokens": summary["mean_completion_tokens"],
        "hit_limit_rate": summary["hit_limit_rate"],
        "dtype": result["metadata"]["dtype"],
        "device": result["metadata"]["device"],
        "peak_gib": peaks.peaks["evaluation"] if backend == "hf" else None,
        "plan_gib": plan,
    }


def stage_train(args: list[str], workdir: str, toy: bool, pixels: int) -> dict[str, Any]:
    """In this process: one GRPO step of the seed's recipe through `recipes/train.py`, TRL's `step_time`, the peak
    GPU memory of each phase and the plan's figure for it."""
    import runpy

    import vision_grpo.training.trainer
    from vision_grpo.plan.check import recipe_plan

    argv = ["--config", SEED_RECIPE, *args, "--output_dir", workdir, "--run_name", "check", "--max_steps", "1"]
    argv += ["--save_strategy", "no", "--logging_steps", "1", "--report_to", "tensorboard"]
    argv += ["--token_check_samples", "8"]
    if toy:  # one micro-batch of 8 completions of 8 tokens
        argv += ["--gradient_accumulation_steps", "1", "--max_completion_length", "8"]
    plan, _ = recipe_plan([*argv, "--image_pixels", str(pixels)])
    peaks = PhasePeaks()
    # recipes/train.py builds the trainer by the name it imports; in this benchmark process alone that name is a thin
    # subclass that reads the GPU's peak at each phase boundary.
    vision_grpo.training.trainer.VisionGRPOTrainer = phase_measured_trainer(peaks)
    start = time.perf_counter()
    runpy.run_path(str(REPO / "recipes" / "train.py"))["main"](argv)
    log = read_step_log(Path(workdir) / "check")
    return {
        "s_per_step": log.step_times[0],
        "stage_wall_s": time.perf_counter() - start,
        "peak_gib": {phase: peaks.peaks.get(phase) for phase in STEP_PHASES},
        "phase_calls": {phase: peaks.calls[phase] for phase in STEP_PHASES},
        "plan_gib": step_plan_phases(plan, card_bytes()),
        "plan_sizes": plan.sizes,
    }


def vllm_unavailable() -> str | None:
    """Why the vLLM parts cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return 'vllm is not importable here (GPU: pip install "vllm>=0.22,<0.32", docs/scaling.md)'
    if not cuda():
        return "no CUDA GPU (vLLM on a CPU runs only in tests_vllm/, `make test-vllm`)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/gpu_check", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--workdir", default="/tmp/vision-grpo-gpu-check", help="weights (~9 GB a model), runs")
    parser.add_argument("--models", nargs="+", default=["qwen3.5-4b"], choices=list(MODELS), help="evaluated")
    parser.add_argument("--eval-items", type=int, default=100)
    parser.add_argument("--eval-batch", type=int, default=50, help="at least 2 (the plan's figure needs 2)")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--budget-s", type=float, default=570, help="the whole check's time limit")
    parser.add_argument("--dry-run", action="store_true", help="replica size on any machine, every part")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--stage-args", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        call = {"eval": stage_eval, "train": stage_train}[args.stage]
        print("STAGE " + json.dumps(call(**json.loads(args.stage_args))), flush=True)
        return
    if args.eval_batch < 2:
        parser.error("--eval-batch must be at least 2")
    if not (args.dry_run or cuda()):
        sys.exit("no CUDA GPU: --dry-run runs every part at replica size on this machine")
    budget, toy = Budget(args.budget_s), args.dry_run

    import torch

    from vision_grpo.data.geoqa_fixture import write_fixture

    result: dict[str, Any] = {"dry_run": toy, "gpu": torch.cuda.get_device_name(0) if cuda() else None}
    result["models"] = {name: {"parameters": parameter_count(name)} for name in MODELS}
    result["models"]["qwen3.5-4b"]["gated_deltanet_path"] = gated_deltanet_path()  # kernels or torch, on this machine
    print(describe_gated_deltanet_path(result["models"]["qwen3.5-4b"]["gated_deltanet_path"]))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    fixture = workdir / "geoqa_fixture.parquet"
    if not fixture.exists():
        write_fixture(fixture, train_rows=16)
    names = sorted(set(args.models) | {"qwen3.5-4b"}, key=lambda name: name != "qwen3.5-4b")  # the seed's first
    built = {name: build(name, workdir / (f"{name}-toy" if toy else name), toy) for name in names}
    if cuda():  # the built weights' memory back to the GPU, for the parts' processes (vLLM checks what is free)
        torch.cuda.empty_cache()
    shared = {name: common_args(name, built[name], fixture, toy) for name in names}
    pixels = {name: plan_pixels(name, fixture) for name in names}
    no_vllm = vllm_unavailable()
    script = Path(__file__).resolve()

    def evaluation(name: str, backend: str) -> None:
        key = f"eval_{backend}:{name}"
        if backend == "vllm" and no_vllm:
            return budget.skip(key, EVAL_CAPS[backend], no_vllm)
        stage = {"recipe": MODELS[name]["recipe"], "args": shared[name], "backend": backend, "pixels": pixels[name]}
        stage.update(output=str(workdir / f"{name}-{backend}.json"), batch=args.eval_batch, items=args.eval_items)
        stage["tokens"] = args.max_new_tokens
        figures = budget.run(key, EVAL_CAPS[backend], lambda cap: run_part(script, "eval", stage, cap))
        evals.setdefault(name, {})[backend] = figures or None

    def train(key: str) -> None:
        overrides, _, cap = TRAIN_PARTS[key]
        if overrides is VLLM_COLOCATE and no_vllm:
            return budget.skip(key, cap, no_vllm)
        stage = {"args": [*shared["qwen3.5-4b"], *EVERY_ROW, *overrides], "workdir": str(workdir / key), "toy": toy}
        stage["pixels"] = pixels["qwen3.5-4b"]
        shutil.rmtree(workdir / key, ignore_errors=True)  # one step each time, never a resume of the last check
        step[key] = budget.run(key, cap, lambda cap: run_part(script, "train", stage, cap)) or None

    evals: dict[str, dict[str, Any]] = {}
    step: dict[str, Any] = {}
    evaluation("qwen3.5-4b", "hf")  # the parts in the order of the docstring: the most wanted first
    train("train_hf")
    train("train_hf_trl_pass")
    train("train_vllm")
    evaluation("qwen3.5-4b", "vllm")
    train("train_hf_per_copy")
    for name in names[1:]:
        evaluation(name, "hf")
        evaluation(name, "vllm")

    result.update(seed_step=step, evaluation=evals, parts=budget.as_json())
    result["entries"] = step_entries(step, {key: label for key, (_, label, _) in TRAIN_PARTS.items()}, budget)
    for name in names:
        result["entries"] += eval_entries(name, evals.get(name, {}), budget, args.max_new_tokens)
    where = result["gpu"] or "CPU, dry run at replica size (times not comparable with the seed's)"
    title = f"GPU check: {where}; Gated DeltaNet path {result['models']['qwen3.5-4b']['gated_deltanet_path']}"
    json_path, table_path = write_outputs(Path(args.out), result, title)
    print(table_path.read_text(encoding="utf-8"))
    print(f"wrote {json_path} and {table_path}")


if __name__ == "__main__":
    main()
