"""Evaluation throughput: our evaluator batched against one prompt at a time, and a LoRA adapter merged or not.

    python benchmarks/eval_throughput.py [--items 64] [--batch-sizes 8 32] [--rounds 3] [--quick]

Everything goes through `eval/evaluate.py`'s own functions (`build_evaluator`, `run_evaluation`), on the tiny
recipe's held-out rows, greedy, the recipe's completion length. samples/s is the evaluator's own figure (generation
and scoring, model loading excluded). After one untimed warm-up pass per model, the configurations take turns
within each round, so a load change on the shared machine hits all of them; ratios are per round, then the median.
Answers must not depend on the batch: every configuration's texts are compared with one-at-a-time's, item by item.

The adapter is a LoRA of the recipe's shape with random (non-zero) weights, so that it changes the answers; its
answers differ from the base model's, and so may their lengths (tokens/answer): compare speeds within a model.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from common import RECIPE, machine, markdown_table, median, report
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.evaluation.backends import build_evaluator
from vision_grpo.evaluation.eval_options import EvalArguments
from vision_grpo.evaluation.evaluate import run_evaluation
from vision_grpo.models.loading import load_model, max_pixels_of
from vision_grpo.models.lora import get_peft_config
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe


def random_adapter(model_args: ModelConfig, task_args: TaskArguments, folder: Path) -> Path:
    """Save a LoRA adapter of the recipe's configuration whose weights are random, not the usual zero B."""
    from peft import get_peft_model

    config = get_peft_config(model_args, task_args)
    config.init_lora_weights = False  # both LoRA matrices random: the adapter really changes the model
    get_peft_model(load_model(model_args), config).save_pretrained(str(folder))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=64, help="held-out items evaluated per configuration")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32], help="batched configurations")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; every configuration runs once per round")
    parser.add_argument("--quick", action="store_true", help="smallest setting: 8 items, batch 8, one round")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.quick:
        args.items, args.batch_sizes, args.rounds = 8, [8], 1

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        argv = ["--config", str(RECIPE), "--shapes_eval_size", str(args.items), "--output", f"{tmp}/eval.json"]
        task, train, model_args, eval_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig, EvalArguments), argv)
        adapter = str(random_adapter(model_args, task, Path(tmp) / "adapter"))
        evaluators = {
            "base": build_evaluator(task, train, model_args, eval_args)[0],
            "adapter": build_evaluator(task, train, model_args, EvalArguments(adapter=adapter))[0],
            "adapter merged": build_evaluator(
                task, train, model_args, EvalArguments(adapter=adapter, merge_adapter=True)
            )[0],
        }
        dataset = get_dataset(task, "eval", max_pixels_of(evaluators["base"].processor))
        big = max(args.batch_sizes)
        configs = [("base", 1)] + [("base", b) for b in args.batch_sizes]
        configs += [("adapter", 1), ("adapter", big), ("adapter merged", big)]
        speeds: dict[tuple[str, int], list[float]] = {config: [] for config in configs}
        texts: dict[tuple[str, int], list[str]] = {}
        tokens: dict[tuple[str, int], float] = {}
        # The first generations of a fresh model are several times slower (lazy kernel set-up): not measured.
        eval_args.batch_size = big
        for evaluator in evaluators.values():
            run_evaluation(evaluator, dataset.select(range(min(big, len(dataset)))), eval_args, 4, {})
        for _ in range(args.rounds):
            for name, batch in configs:
                eval_args.batch_size = batch
                result = run_evaluation(evaluators[name], dataset, eval_args, train.max_completion_length, {})
                speeds[(name, batch)].append(result["summary"]["samples_per_s"])
                texts[(name, batch)] = [record["text"] for record in result["records"]]
                tokens[(name, batch)] = result["summary"]["mean_completion_tokens"]

    def same(config: tuple[str, int], reference: tuple[str, int]) -> int:
        return sum(a == b for a, b in zip(texts[config], texts[reference], strict=True))

    def ratio(config: tuple[str, int], reference: tuple[str, int]) -> float:
        return median([a / b for a, b in zip(speeds[config], speeds[reference], strict=True)])

    rows: list[list[Any]] = []
    figures: dict[str, Any] = {"items": args.items, "rounds": args.rounds, "machine": machine()}
    for name, batch in configs:
        one = (name.replace(" merged", ""), 1)
        speedup = ratio((name, batch), one)
        answers = f"{same((name, batch), one)}/{args.items}"
        rows.append([name, batch, median(speeds[(name, batch)]), speedup, answers, tokens[(name, batch)]])
        figures[f"{name} batch {batch}"] = {
            "samples_per_s": median(speeds[(name, batch)]),
            "speedup_vs_batch_1": speedup,
            "same_answers_as_batch_1": same((name, batch), one),
        }
    merged_speedup = ratio(("adapter merged", big), ("adapter", big))
    figures["merged_vs_unmerged"] = merged_speedup
    figures["batching_speedup"] = ratio(("base", big), ("base", 1))
    print(f"\nEvaluator throughput, tiny model, {args.items} items, {args.rounds} round(s) ({machine()})")
    headers = ["model", "batch", "samples/s", "x one-at-a-time", "answers same as batch 1", "tokens/answer"]
    print(markdown_table(headers, rows))
    print(
        f"batching speed-up (batch {big} / batch 1, base): {figures['batching_speedup']:.2f}x  target >= 4x: "
        f"{'met' if figures['batching_speedup'] >= 4 else 'NOT met'}"
    )
    print(f"adapter merged / unmerged at batch {big}: {merged_speedup:.2f}x")
    report("eval_throughput", figures, args.json)


if __name__ == "__main__":
    main()
