"""Where start-up time goes: the stages of `recipes/train.py` before its first step, timed one by one.

    python benchmarks/startup.py [--recipe recipes/shapes/tiny_cpu.yaml]

Run as its own process (run_all does), so the import stages are a fresh interpreter's. The stages are the entry
point's own calls in its order; the cold model build is timed into a temporary folder and shows what every run
would pay if the embedded model were not cached. Compare the total with `train_overhead.py`'s start-up figure.
"""

from __future__ import annotations

import argparse
import runpy
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import RECIPE, REPO, machine, markdown_table, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--quick", action="store_true", help="accepted for run_all; the stages are the same")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    stages: dict[str, float] = {}

    def timed(name: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = call()
        stages[name] = time.perf_counter() - start
        return result

    timed("import torch", lambda: __import__("torch"))
    timed("import transformers, trl, peft", lambda: (__import__("trl").GRPOTrainer, __import__("peft").LoraConfig))

    # The entry point's module body is its imports (callbacks, data, rewards, runs); `main` does not run.
    timed("import the entry point's modules", lambda: runpy.run_path(str(REPO / "recipes" / "train.py")))
    from trl import GRPOConfig

    from vision_grpo.data import get_dataset
    from vision_grpo.models.embedded import TINY_MODEL
    from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
    from vision_grpo.models.lora import get_peft_config
    from vision_grpo.models.replicas.build import build_replica
    from vision_grpo.models.visual_tokens import check_visual_tokens
    from vision_grpo.rewards import get_recipe_rewards
    from vision_grpo.run.manifest import write_run_start
    from vision_grpo.run.recipe_run import RecipeRun
    from vision_grpo.run.stopping import GracefulStop
    from vision_grpo.training.hparams import TensorBoardHParams, recipe_hparams
    from vision_grpo.training.trainer import VisionGRPOTrainer

    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        argv = ["--config", args.recipe, "--output_dir", tmp, "--run_name", "bench", "--report_to", "none"]
        run = timed("parse the recipe, run folder", lambda: RecipeRun.start(GRPOConfig, argv))
        task, train, model_args = run.task_args, run.training_args, run.model_args
        if model_args.model_name_or_path == TINY_MODEL:
            timed("build the tiny model (cold cache only)", lambda: build_replica("qwen2.5-vl", Path(tmp) / "cold"))
        processor = timed("processor (cached model)", lambda: get_processor(model_args, task))
        rewards = timed("reward plugins", lambda: get_recipe_rewards(task, processor.tokenizer))
        model = timed("model weights", lambda: load_model(model_args))
        dataset = timed("dataset rows", lambda: get_dataset(task, "train", max_pixels_of(processor)))
        timed(
            "visual-token check",
            lambda: check_visual_tokens(
                dataset, processor, model.config, task.token_check_samples, train.chat_template_kwargs or {}
            ),
        )

        def trainer() -> VisionGRPOTrainer:
            built = VisionGRPOTrainer(
                model=model,
                reward_funcs=rewards,
                args=train,
                train_dataset=dataset,
                processing_class=processor,
                peft_config=get_peft_config(model_args, task),
                callbacks=[TensorBoardHParams(run.run_dir, recipe_hparams(task, train, model_args))],
            )
            built.add_callback(GracefulStop(built.accelerator))  # as recipes/train.py adds it
            return built

        timed("trainer (LoRA wrapping, optimizer set-up)", trainer)
        timed(
            "run manifest (git state, versions)",
            lambda: write_run_start(run.run_dir, run.recipe_path, argv, (task, train, model_args)),
        )

    warm_total = sum(v for k, v in stages.items() if "cold" not in k)
    rows = [
        [name, seconds, f"{100 * seconds / warm_total:.0f}%" if "cold" not in name else "-"]
        for name, seconds in stages.items()
    ]
    rows.append(["total with a cached model", warm_total, "100%"])
    print(f"\nStart-up stages of recipes/train.py, {Path(args.recipe).name} ({machine()})")
    print(markdown_table(["stage", "seconds", "share"], rows))
    report("startup", {"stages_s": stages, "warm_total_s": warm_total, "machine": machine()}, args.json)


if __name__ == "__main__":
    main()
