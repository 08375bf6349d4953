"""The sampler/trainer logprob gap that numerics alone produce, in float32 and bf16 on the CPU: what the logprob-gap
guard (vision_grpo/training/logprob_guard.py) must tolerate on a correct run.

    python benchmarks/logprob_gap.py [--models vision-grpo/tiny-qwen2.5-vl ... runs/.../demo] [--rows 8]

For each model and dtype, completions are sampled with transformers' `generate` (the incremental, KV-cached path a
sampler takes), and the sampled tokens' logprobs read from its raw logits; the same completions are then scored by
one forward pass over prompt + completion, as the trainer scores them. Both are log-softmaxed in float32 from the
model's own logits, at the sampling temperature, as TRL and vLLM do. Printed: the mean absolute per-token
difference (TRL's `sampling/sampling_logp_difference/mean`), its RMS and maximum. With `top_p < 1` the sampler's
logprobs are also read after truncation and renormalisation (vLLM's `processed_logprobs`, what TRL asks vLLM for)
and compared with the trainer's untruncated ones: the gap truncation alone adds.
"""

from __future__ import annotations

import argparse

import torch
from common import RECIPE, machine, markdown_table
from transformers import GenerationConfig
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.evaluation.batches import read_batch
from vision_grpo.evaluation.evaluator import Evaluator
from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

FAMILIES = ["vision-grpo/tiny-qwen2.5-vl", "vision-grpo/tiny-qwen3-vl", "vision-grpo/tiny-qwen3.5"]


def gaps(model_name: str, dtype: str, rows: int, new_tokens: int, top_p: float) -> dict[str, float]:
    argv = ["--config", str(RECIPE), "--model_name_or_path", model_name, "--dtype", dtype]
    task_args, train_args, model_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)
    processor = get_processor(model_args, task_args)
    model = load_model(model_args).eval()
    evaluator = Evaluator(model, processor, task_args.task, [], {})
    dataset = get_dataset(task_args, "eval", max_pixels_of(processor))
    batch, images = read_batch(dataset, range(rows))
    inputs = evaluator.encode(batch, images)
    config = GenerationConfig(
        do_sample=True,
        temperature=train_args.temperature,
        top_p=top_p,
        top_k=0,
        max_new_tokens=new_tokens,
        eos_token_id=evaluator.stop_ids,
        pad_token_id=evaluator.pad_id,
        suppress_tokens=evaluator.suppress_ids or None,
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    torch.manual_seed(0)
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=config)
        prompt_length = inputs["input_ids"].shape[1]
        completion = out.sequences[:, prompt_length:]
        raw = torch.stack(out.logits, dim=1).float() / train_args.temperature
        processed = torch.stack(out.scores, dim=1).float()
        sampled_raw = raw.log_softmax(-1).gather(-1, completion[..., None])[..., 0]
        sampled_processed = processed.log_softmax(-1).gather(-1, completion[..., None])[..., 0]
        mask = torch.ones_like(completion, dtype=torch.bool)  # up to and including the first stop token
        for i, ids in enumerate(completion.tolist()):
            end = next((j for j, token in enumerate(ids) if token in evaluator.eos_ids), None)
            if end is not None:
                mask[i, end + 1 :] = False
        full = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
        if "mm_token_type_ids" in full:  # text type for the completion tokens
            full["mm_token_type_ids"] = torch.cat([full["mm_token_type_ids"], torch.zeros_like(completion)], dim=1)
        attention = torch.cat([inputs["attention_mask"], mask.long()], dim=1)
        logits = model(input_ids=out.sequences, attention_mask=attention, **full).logits
        trainer = (logits[:, prompt_length - 1 : -1].float() / train_args.temperature).log_softmax(-1)
        trainer = trainer.gather(-1, completion[..., None])[..., 0]
    delta = (sampled_raw - trainer)[mask].abs()
    truncated = (sampled_processed - trainer)[mask].abs()
    return {
        "mean": delta.mean().item(),
        "rms": delta.pow(2).mean().sqrt().item(),
        "max": delta.max().item(),
        "tokens": int(mask.sum()),
        "truncated_mean": truncated.mean().item(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=FAMILIES)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--top-p", type=float, default=0.8, help="the truncation whose renormalisation is measured")
    args = parser.parse_args(argv)
    table = []
    for model in args.models:
        for dtype in args.dtypes:
            g = gaps(model, dtype, args.rows, args.new_tokens, args.top_p)
            table.append(
                [
                    model,
                    dtype,
                    g["tokens"],
                    f"{g['mean']:.4f}",
                    f"{g['rms']:.4f}",
                    f"{g['max']:.3f}",
                    f"{g['truncated_mean']:.4f}",
                ]
            )
    headers = ["model", "dtype", "tokens", "mean abs gap", "RMS", "max", f"mean abs gap, top_p {args.top_p} processed"]
    print(markdown_table(headers, table))
    print(machine())


if __name__ == "__main__":
    main()
