"""The training pass that pays only for signal against TRL's, at the GeoQA seed's shapes, on replicas of the real
models' proportions.

    python benchmarks/training_pass_costs.py [--quick] [--json FILE]

Models: each family's real config (vision_grpo/plan/model_configs/: Qwen2.5-VL-3B, Qwen3-VL-4B, Qwen3.5-4B) with
every width divided by 16 (hidden, MLP, vision widths; heads divided by 16, at least one, each of the real head
size, one key-value head) and every depth by 4 (Qwen3.5 keeps its three linear-attention layers to one full; the
vision tower's full-attention and deepstack layers keep their relative places), and the embedded replica's
tokenizer and vocabulary. Attention shrinks with one width where the projections and MLPs shrink with two, so it
weighs more here than on the real model (docs/performance.md gives the real models' FLOP counts).

Data: a generation batch of 5 prompts x G = 8 completions, one 1-MP image per prompt (1,296 image tokens at
Qwen2.5-VL's 28-px cells, 1,024 at 32 px) and about 250 text tokens; completion lengths drawn from a lognormal
around the seed's mean (279 tokens) with 2 rows at the 1,024 limit; 2 of the 5 groups (40%) with equal rewards.
Training as the seed's recipe: LoRA on the language model, frozen tower, activation checkpointing, `beta: 0`,
`dr_grpo`, AdamW at 4e-5, 8 completions per micro-batch, one optimizer step per generation batch.

Both paths run the real trainer (VisionGRPOTrainer) with the training-pass keys on ("new") and off ("before", TRL's
per-copy pass), on the same fixed completions: `_generate_and_score_completions` returns the batch above. Each run
is its own process (peak memory is per process), before and new alternating, the main family twice each; ratios are
of the medians (`--quick`: toy sizes, one run each, the main family only). Printed:
- tokens computed per token with signal: token positions the training forwards computed over prompt tokens of
  groups that train plus completion tokens of rows that train (`training_pass/positions_*` of the trainer's log);
- training pass: TRL's `step_time` (its `training_step`s: micro-batch forming, forwards, backwards);
- step: the training step's wall time plus one HF generation of the batch (the same on both paths, measured once
  in its own process: all rows decoded to the 1,024-token limit, which the rows at the limit force);
- decoding with each prompt's keys and values held once (`share_decode_cache`) against a copy per row: the time of
  128 decoded tokens, alternating, medians (the memory it saves: tests/test_shared_prefill.py and the plan);
- peak memory: the training process's peak resident memory above what it held before training;
- max |log-prob difference| over the batch's completion tokens, and max |weight difference| after 3 steps.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import child_figures, machine, report, scaled_config
from datasets import Dataset
from PIL import Image
from transformers import AutoModelForImageTextToText, TrainerCallback
from trl import GRPOConfig, ModelConfig

from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.models.lora import get_peft_config
from vision_grpo.models.processing import load_processor
from vision_grpo.models.shared_prefill import share_prefill
from vision_grpo.models.shared_vision import share_vision_tower
from vision_grpo.models.vision import freeze_vision_tower
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.training.trainer import VisionGRPOTrainer

FAMILIES = {
    "Qwen2.5-VL": ("Qwen--Qwen2.5-VL-3B-Instruct", "vision-grpo/tiny-qwen2.5-vl"),
    "Qwen3-VL": ("Qwen--Qwen3-VL-4B-Instruct", "vision-grpo/tiny-qwen3-vl"),
    "Qwen3.5": ("Qwen--Qwen3.5-4B", "vision-grpo/tiny-qwen3.5"),
}
MAIN = "Qwen2.5-VL"
FULL = {"side": 1008, "groups": 5, "dead": 2, "mean": 279, "limit": 1024, "at_limit": 2, "text": 250, "steps": 3}
FULL["decode"] = 128
QUICK = {"side": 112, "groups": 2, "dead": 1, "mean": 12, "limit": 24, "at_limit": 1, "text": 20, "steps": 3}
QUICK["decode"] = 8
G = 8
WIDTH, DEPTH = 16, 4
TRL_PASS = {"share_prompt_in_training": False, "balance_micro_batches": False, "skip_zero_advantage": False}


def generation_batch(processor: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """What `_generate_and_score_completions` returns for the module docstring's batch (seeded)."""
    generator = torch.Generator().manual_seed(0)
    tokenizer = processor.tokenizer
    words = " ".join(["in the figure the angle at the centre is twice the one on the circle"] * 40)
    question = tokenizer.decode(tokenizer(words)["input_ids"][: sizes["text"]])
    texts, images = [], []
    for group in range(sizes["groups"]):
        pixels = torch.rand(sizes["side"], sizes["side"], 3, generator=generator) * 255
        content = [{"type": "image"}, {"type": "text", "text": f"{group}. {question}"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        texts += [text] * G
        images += [Image.fromarray(pixels.byte().numpy())] * G
    encoded = processor(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left")
    rows = len(texts)
    lengths = _completion_lengths(rows, sizes, generator)
    width = int(lengths.max())
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    special = set(processor.tokenizer.all_special_ids)
    vocabulary = torch.tensor([t for t in range(len(tokenizer)) if t not in special])
    ids = vocabulary[torch.randint(len(vocabulary), (rows, width), generator=generator)]
    ends = lengths < sizes["limit"]
    ids[torch.arange(rows)[ends], lengths[ends] - 1] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = ids * mask + tokenizer.pad_token_id * (1 - mask)
    rewards = (torch.rand(rows, generator=generator) < 0.5).float().view(sizes["groups"], G)
    rewards[: sizes["dead"]] = 1.0  # groups whose rewards are all equal
    rewards[sizes["dead"] :, 0], rewards[sizes["dead"] :, 1] = 0.0, 1.0  # the others have signal
    advantages = (rewards - rewards.mean(-1, keepdim=True)).view(-1)  # scale_rewards: none (the seed's)
    return {
        "prompt_ids": encoded["input_ids"],
        "prompt_mask": encoded["attention_mask"],
        "completion_ids": ids,
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum(),
        "pixel_values": encoded["pixel_values"],
        "image_grid_thw": encoded["image_grid_thw"],
        "num_images": [1] * rows,
        "mm_token_type_ids": torch.cat([encoded["mm_token_type_ids"], torch.zeros_like(mask)], dim=1),
    }


def _completion_lengths(rows: int, sizes: dict[str, int], generator: torch.Generator) -> torch.Tensor:
    """Lognormal lengths (sigma 0.6) scaled so that, with `at_limit` rows at the limit, the mean is `mean`."""
    draws = torch.exp(0.6 * torch.randn(rows, generator=generator))
    free = rows - sizes["at_limit"]
    target = (sizes["mean"] * rows - sizes["limit"] * sizes["at_limit"]) / free
    lengths = (draws[:free] * target / draws[:free].mean()).round().clamp(2, sizes["limit"] - 1).long()
    lengths = torch.cat([lengths, torch.full((sizes["at_limit"],), sizes["limit"])])
    return lengths[torch.randperm(rows, generator=generator)]


def trainer_for(family: str, path: str, sizes: dict[str, int], workdir: Path) -> tuple[Any, dict[str, Any]]:
    """A VisionGRPOTrainer of the scaled model with the seed's training settings, generating the fixed batch."""
    pixels = sizes["side"] ** 2
    processor = load_processor(resolve_model_path(FAMILIES[family][1]), min_pixels=3136, max_pixels=pixels)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        scaled_config(*FAMILIES[family], WIDTH, DEPTH), attn_implementation="sdpa"
    )
    freeze_vision_tower(model)
    batch = generation_batch(processor, sizes)
    rows = batch["prompt_ids"].shape[0]
    args = GRPOConfig(
        output_dir=str(workdir),
        max_steps=sizes["steps"],
        per_device_train_batch_size=G,
        gradient_accumulation_steps=rows // G,
        num_generations=G,
        max_completion_length=sizes["limit"],
        learning_rate=4e-5,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        activation_checkpointing=True,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=42,
        dataloader_pin_memory=False,
    )
    lora = ModelConfig(use_peft=True, lora_r=2, lora_alpha=2, lora_dropout=0.0)  # the seed's r 32, width / 16
    keys = {} if path == "new" else TRL_PASS
    trainer = VisionGRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "unused"}] * (rows * sizes["steps"])),
        processing_class=processor,
        peft_config=get_peft_config(lora, TaskArguments()),
        **keys,
    )
    trainer._generate_and_score_completions = lambda _: dict(batch)
    return trainer, batch


def run_path(family: str, path: str, sizes: dict[str, int], save: Path | None) -> dict[str, Any]:
    """One path's training in this process: per-step pass and step times, peak memory, positions; weights saved."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer, _ = trainer_for(family, path, sizes, Path(tmp))
        walls: list[float] = []

        class StepWall(TrainerCallback):
            def on_step_begin(self, *_, **__):
                walls.append(time.perf_counter())

            def on_step_end(self, *_, **__):
                walls[-1] = time.perf_counter() - walls[-1]

        trainer.add_callback(StepWall())
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        trainer.train()
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        logged = [entry for entry in trainer.state.log_history if "step_time" in entry]
        if save is not None:
            weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
            torch.save(weights, save)
    return {
        "pass_s": [entry["step_time"] for entry in logged],
        "step_s": walls,
        "peak_mib": (peak_kib - rss_before) / 1024,
        "positions_computed": [entry["training_pass/positions_computed"] for entry in logged],
        "positions_with_signal": [entry.get("training_pass/positions_with_signal") for entry in logged],
    }


def log_prob_difference(family: str, sizes: dict[str, int]) -> dict[str, float]:
    """Max |log-prob difference| between the two paths over the batch's completion tokens, one model."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer, batch = trainer_for(family, "new", sizes, Path(tmp))
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        images = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")}
        width = batch["completion_ids"].shape[1]
        results = []
        with torch.no_grad():
            for share in (False, True):
                trainer.share_prompt_in_training = share
                results.append(trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width, **images)[0])
        difference = ((results[0] - results[1]) * batch["completion_mask"]).abs().max()
        return {"max_log_prob_difference": float(difference)}


def generations(family: str, sizes: dict[str, int]) -> dict[str, Any]:
    """HF generation of the batch's prompts as the trainer installs it: once to the completion limit; then, for the
    decode cache, `decode` tokens with each prompt's keys and values held once and with a copy per row, alternating,
    twice each (the same prefill, the same samples: the time is the layers' expansion of the prompt part)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer, batch = trainer_for(family, "new", sizes, Path(tmp))
    model = trainer.model.eval()
    share_vision_tower(model)
    inputs = {"input_ids": batch["prompt_ids"], "attention_mask": batch["prompt_mask"]}
    inputs.update({k: batch[k] for k in ("pixel_values", "image_grid_thw")})
    inputs["mm_token_type_ids"] = batch["mm_token_type_ids"][:, : batch["prompt_ids"].shape[1]]

    def timed(tokens: int, once: bool) -> float:
        share_prefill(model, share_cache=once)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True)
        return time.perf_counter() - start

    decode: dict[str, list[float]] = {"once": [], "copied": []}
    for _ in range(2):
        for once in (True, False):
            decode["once" if once else "copied"].append(timed(sizes["decode"], once))
    return {"generation_s": timed(sizes["limit"], True), "decode_s": decode}


def run_child(work: Callable[..., dict[str, Any]], family: str, *args: Any) -> dict[str, Any]:
    """`work(family, *args)` in a process of its own (peak memory is per process); its figures, also on stderr."""
    what = " ".join([family, work.__name__, *(arg for arg in args if isinstance(arg, str))])
    result = child_figures(work, family, *args, what=what)
    print(f"  {what}: {result}", file=sys.stderr, flush=True)
    return result


def weight_difference(a: Path, b: Path) -> float:
    before, new = torch.load(a), torch.load(b)
    if before.keys() != new.keys():
        raise RuntimeError("the two paths trained different parameters")
    return max(float((before[k] - new[k]).abs().max()) for k in before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes, one run each, the main family only")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = QUICK if args.quick else FULL
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        saved = {path: Path(tmp) / f"{path}.pt" for path in ("before", "new")}
        for repeat in range(1 if args.quick else 2):
            for path in ("before", "new"):
                save = saved[path] if repeat == 0 else None
                runs.setdefault((MAIN, path), []).append(run_child(run_path, MAIN, path, sizes, save))
        weights = weight_difference(saved["before"], saved["new"])
    for family in FAMILIES:
        if family != MAIN and not args.quick:
            for path in ("before", "new"):
                runs.setdefault((family, path), []).append(run_child(run_path, family, path, sizes, None))
    generated = run_child(generations, MAIN, sizes)
    generation = generated["generation_s"]
    decode_ratio = statistics.median(generated["decode_s"]["once"]) / statistics.median(generated["decode_s"]["copied"])
    log_probs = run_child(log_prob_difference, MAIN, sizes)["max_log_prob_difference"]

    def median(family: str, path: str, key: str) -> float:
        return statistics.median(value for run in runs[family, path] for value in _values(run[key]))

    def ratio(family: str, key: str) -> float:
        return median(family, "before", key) / median(family, "new", key)

    signal = sum(runs[MAIN, "new"][0]["positions_with_signal"])  # the batch's; TRL's pass does not count it

    def per_signal(path: str) -> float:
        return sum(runs[MAIN, path][0]["positions_computed"]) / signal

    step_before = generation + median(MAIN, "before", "step_s")
    step_new = generation + median(MAIN, "new", "step_s")
    figures = {
        "machine": machine(),
        "sizes": sizes,
        "tokens_per_signal": {"before": per_signal("before"), "new": per_signal("new")},
        "pass_ratio": ratio(MAIN, "pass_s"),
        "step_ratio": step_before / step_new,
        "generation_s": generation,
        "decode_time_ratio": decode_ratio,
        "peak_memory_ratio": ratio(MAIN, "peak_mib"),
        "max_log_prob_difference": log_probs,
        "max_weight_difference": weights,
        "family_pass_ratio": {family: ratio(family, "pass_s") for family in FAMILIES if (family, "new") in runs},
        "runs": {f"{family}/{path}": values for (family, path), values in runs.items()},
    }
    tokens = figures["tokens_per_signal"]
    print(f"training tokens computed per token with signal: new {tokens['new']:.2f}, before {tokens['before']:.2f}")
    print(f"training pass time before / new: {figures['pass_ratio']:.2f}x")
    print(f"step time before / new: {figures['step_ratio']:.2f}x")
    print(f"peak memory before / new: {figures['peak_memory_ratio']:.2f}x")
    print(f"max |log-prob difference|: {log_probs:.3g}; max |weight difference after 3 steps|: {weights:.3g}")
    for family, value in figures["family_pass_ratio"].items():
        print(f"{family}: training pass before / new: {value:.2f}x")
    print(f"generation in the step: {generation:.1f} s; decoding, prompt cache once / copied: {decode_ratio:.2f}x")
    report("training_pass_costs", figures, args.json)


def _values(value: Any) -> list[float]:
    return list(value) if isinstance(value, list) else [value]


if __name__ == "__main__":
    main()
