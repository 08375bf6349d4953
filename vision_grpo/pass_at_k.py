"""pass@k on the recipe's held-out images: k completions per image, sampled as GRPO samples them in training.

Greedy accuracy says what a model answers; pass@k says whether a right answer is among what it samples, which is
all a GRPO group can find and reinforce. Comparing the two before and after GRPO shows what GRPO turned into greedy
accuracy. Model loading, prompts, pixels, stop and suppressed tokens, the cut after EOS and scoring are the
evaluator's own (`build_evaluator`, `Evaluator.encode`, `Evaluator.completion`, its scorer): one path for prompts.
The sampling settings are the recipe's training ones (temperature, top-p, top-k, min-p, repetition penalty,
completion length), as TRL's GRPOTrainer builds them, and nothing from the checkpoint's generation config.

    python -m vision_grpo.pass_at_k --config recipes/shapes/tiny_grpo_demo.yaml \\
        --model_name_or_path runs/shapes/tiny_grpo_demo/demo --k 8 --output results/grpo_pass8.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig
from trl import GRPOConfig, ModelConfig

from vision_grpo.config import TaskArguments, parse_recipe, recipe_path_of
from vision_grpo.data import get_dataset
from vision_grpo.eval.evaluate import EvalArguments, write_json_atomic
from vision_grpo.evaluator import SEED, Evaluator, build_evaluator, default_max_new_tokens, only_generation_config
from vision_grpo.modeling import max_pixels_of
from vision_grpo.runs import dataset_identity


@dataclass
class SamplingArguments:
    """How many completions to sample per image."""

    k: int = field(default=8, metadata={"help": "Completions sampled per held-out image."})

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}")


def sampling_config(evaluator: Evaluator, train_args: GRPOConfig, k: int, max_new_tokens: int) -> GenerationConfig:
    """The generation settings of GRPO training (TRL's own list), returning `k` samples per prompt.

    The vision tokens are suppressed as in training (`VisionGRPOTrainer`) and in the evaluator: a sampled image token
    has no image features.
    """
    return GenerationConfig(
        do_sample=True,
        num_return_sequences=k,
        max_new_tokens=max_new_tokens,
        temperature=train_args.temperature,
        top_p=train_args.top_p,
        top_k=train_args.top_k,
        min_p=train_args.min_p,
        repetition_penalty=train_args.repetition_penalty,
        pad_token_id=evaluator.pad_id,
        eos_token_id=evaluator.stop_ids,
        suppress_tokens=evaluator.suppress_ids or None,
    )


@torch.inference_mode()
def sample_records(
    evaluator: Evaluator, dataset: Any, config: GenerationConfig, batch_size: int
) -> list[dict[str, Any]]:
    """One record per image: its id, gold answer, and per sample the text, whether it is right and whether cut off."""
    records = []
    for first in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(first, min(first + batch_size, len(dataset)))]
        inputs = evaluator.encode(rows, [row["image"] for row in rows])
        with only_generation_config(evaluator.model, config):
            output = evaluator.model.generate(**inputs, generation_config=config)
        samples = [evaluator.completion(ids) for ids in output[:, inputs["input_ids"].shape[1] :].tolist()]
        k = config.num_return_sequences
        for index, row in enumerate(rows):  # generate returns the k samples of each prompt next to each other
            mine = samples[index * k : (index + 1) * k]
            scores = [evaluator.score(row, sample["text"]) for sample in mine]
            records.append(
                {
                    "id": row["id"],
                    "gold": scores[0]["gold"],
                    "texts": [sample["text"] for sample in mine],
                    "correct": [score["correct"] for score in scores],
                    "hit_limit": [sample["hit_limit"] for sample in mine],
                }
            )
    return records


def summarize_samples(records: list[dict[str, Any]]) -> dict[str, Any]:
    """pass@1 (mean sampled accuracy), pass@k (some sample right), both by gold answer, and truncation.

    With exactly k samples per image pass@k is the share of images with at least one right sample (the unbiased
    estimator of Chen et al. 2021 reduces to it when n = k).
    """
    by_gold: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_gold[record["gold"]].append(record)

    def rates(group: list[dict[str, Any]]) -> tuple[float, float]:
        pass_1 = sum(sum(r["correct"]) / len(r["correct"]) for r in group) / len(group)
        return pass_1, sum(1 for r in group if any(r["correct"])) / len(group)

    pass_1, pass_k = rates(records)
    samples = [cut for r in records for cut in r["hit_limit"]]
    return {
        "n": len(records),
        "k": len(records[0]["correct"]),
        "pass_at_1": pass_1,
        "pass_at_k": pass_k,
        "pass_at_1_by_count": {gold: rates(group)[0] for gold, group in sorted(by_gold.items())},
        "pass_at_k_by_count": {gold: rates(group)[1] for gold, group in sorted(by_gold.items())},
        "hit_limit_rate": sum(samples) / len(samples),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Sample `--k` completions per held-out image; write and return {"summary", "metadata", "records"}."""
    argv = sys.argv[1:] if argv is None else argv
    task_args, train_args, model_args, eval_args, sampling_args = parse_recipe(
        (TaskArguments, GRPOConfig, ModelConfig, EvalArguments, SamplingArguments), argv
    )
    output = Path(eval_args.output)
    if not output.parent.is_dir():
        raise FileNotFoundError(f"output folder {output.parent} does not exist: create it or choose another --output")
    evaluator, processor = build_evaluator(task_args, train_args, model_args, eval_args)
    dataset = get_dataset(task_args, "eval", max_pixels_of(processor))
    if eval_args.limit:
        dataset = dataset.select(range(min(eval_args.limit, len(dataset))))
    max_new_tokens = eval_args.max_new_tokens or default_max_new_tokens(task_args, train_args)
    config = sampling_config(evaluator, train_args, sampling_args.k, max_new_tokens)
    torch.manual_seed(SEED)
    records = sample_records(evaluator, dataset, config, eval_args.batch_size)
    metadata = {
        "recipe": recipe_path_of(argv),
        "argv": argv,
        "model": model_args.model_name_or_path,
        "adapter": eval_args.adapter,
        "dataset": dataset_identity(task_args),
        "decoding": {key: getattr(config, key) for key in ("temperature", "top_p", "top_k", "min_p", "max_new_tokens")},
        "k": sampling_args.k,
        "batch_size": eval_args.batch_size,  # the samples depend on it: one random stream per batch
        "seed": SEED,
    }
    result = {"summary": summarize_samples(records), "metadata": metadata, "records": records}
    write_json_atomic(output, result)
    return result


if __name__ == "__main__":
    print(json.dumps(main()["summary"], indent=1))
