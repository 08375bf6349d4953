"""Evaluate a base model, a trained model or a saved adapter with the recipe it was trained with.

    python eval/evaluate.py --config recipes/geoqa/qwen3_5_4b_lora.yaml --output results/base.json
    python eval/evaluate.py --config recipes/geoqa/qwen3_5_4b_lora.yaml \\
        --adapter runs/geoqa/qwen3_5_4b_lora/<run>/checkpoint-100 --output results/step100.json

The model, prompt, pixel limits and chat-template switches come from the recipe (any key can be overridden on the
command line), and the examples come from the same `get_dataset` as training: the held-out split (`eval`) of the
task. Decoding is greedy and batched with left padding. Records are appended to `<output>.partial.jsonl` as they
finish (after a header line holding the run's settings), so `--resume` continues an interrupted run with the same
settings; the final JSON is written atomically.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from tqdm.auto import tqdm
from trl import GRPOConfig, ModelConfig

from vision_grpo.config import TaskArguments, parse_recipe, recipe_path_of
from vision_grpo.data import get_dataset, shape_spec
from vision_grpo.eval.adapters import adapter_base_model, check_adapter_dir, load_verified_adapter
from vision_grpo.eval.scoring import SCORERS, summarize
from vision_grpo.modeling import get_processor, load_model, max_pixels_of
from vision_grpo.rewards import get_recipe_rewards
from vision_grpo.runs import package_versions, write_text_atomic
from vision_grpo.training import fill_image

logger = logging.getLogger("vision_grpo.evaluate")
IMAGE_CONTROLS = ("none", "blank", "shuffled")
TIMING_KEYS = ("samples_per_s", "total_seconds")
SEED = 42
GEOQA_MAX_NEW_TOKENS = 1024  # the seed's evaluation limit
# Settings an interrupted run may be resumed with changed: they do not change any record.
RESUME_FREE_KEYS = ("argv", "batch_size")


@dataclass
class EvalArguments:
    """Evaluation options; everything else (model, data, prompt, pixels) comes from the recipe."""

    output: str = field(default="results/eval.json", metadata={"help": "Result JSON (written atomically)."})
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter or checkpoint folder to apply."})
    merge_adapter: bool = field(default=False, metadata={"help": "Merge the adapter into the weights (faster)."})
    batch_size: int = field(default=8, metadata={"help": "Prompts generated together (left padding)."})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "Default: 1024 for GeoQA (the seed's), else the recipe's completion length."}
    )
    limit: int | None = field(default=None, metadata={"help": "Evaluate only the first N examples."})
    resume: bool = field(default=False, metadata={"help": "Continue from `<output>.partial.jsonl`."})
    image_control: str = field(
        default="none", metadata={"help": "`none`, `blank` (white canvas) or `shuffled` (another item's image)."}
    )

    def __post_init__(self) -> None:
        if self.image_control not in IMAGE_CONTROLS:
            raise ValueError(f"image_control must be one of {IMAGE_CONTROLS}, got {self.image_control!r}")
        for name in ("batch_size", "max_new_tokens", "limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")


class Evaluator:
    """Greedy batched generation over prompts built by the training code, scored per example."""

    def __init__(self, model: Any, processor: Any, task: str, reward_funcs: list, chat_template_kwargs: dict) -> None:
        self.model = model.eval()
        self.processor = processor
        self.score = SCORERS[task]
        self.reward_funcs = reward_funcs
        self.chat_template_kwargs = chat_template_kwargs
        tokenizer = processor.tokenizer
        self.eos_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
        self.eos_ids |= set(_as_list(model.generation_config.eos_token_id))

    def encode(self, rows: list[dict[str, Any]], images: list[Image.Image]) -> Any:
        """Model inputs for `rows` with `images` in their image slots, padded on the processor's side (left).

        Padding goes to the processor through `processor_kwargs`; the chat-template switches stay keyword arguments,
        which is where transformers looks for template variables.
        """
        conversations = [fill_image(row["prompt"], image) for row, image in zip(rows, images, strict=True)]
        inputs = self.processor.apply_chat_template(
            conversations,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs={"padding": True},
            **self.chat_template_kwargs,
        )
        # Keep every field the processor returns, as TRL does in training: Qwen-VL models place their multimodal
        # rotary positions with `mm_token_type_ids`; dropping it silently changes what the model sees.
        return inputs.to(self.model.device)

    @torch.inference_mode()
    def generate(self, rows: list[dict[str, Any]], images: list[Image.Image], max_new_tokens: int) -> list[dict]:
        """Completions for `rows` with `images` in their image slots: text, token count, whether cut off."""
        inputs = self.encode(rows, images)
        output = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        results = []
        for ids in output[:, inputs["input_ids"].shape[1] :].tolist():
            end = next((i for i, token in enumerate(ids) if token in self.eos_ids), None)
            kept = ids if end is None else ids[: end + 1]
            results.append(
                {
                    "ids": kept,
                    "text": self.processor.tokenizer.decode(kept, skip_special_tokens=True),
                    "completion_tokens": len(kept),
                    "hit_limit": end is None,
                }
            )
        return results

    def record(self, row: dict[str, Any], generated: dict[str, Any]) -> dict[str, Any]:
        """One result record: id, gold, prediction, correct, tokens, cut off, text, reward parts."""
        columns = {k: [v] for k, v in row.items() if k not in ("prompt", "image", "id")}
        completion = [[{"role": "assistant", "content": generated["text"]}]]
        rewards = {
            func.__name__: func(
                completions=completion, completion_ids=[generated["ids"]], prompts=[row["prompt"]], **columns
            )[0]
            for func in self.reward_funcs
        }
        return {
            "id": row["id"],
            **self.score(row, generated["text"]),
            "completion_tokens": generated["completion_tokens"],
            "hit_limit": generated["hit_limit"],
            "text": generated["text"],
            "rewards": rewards,
        }


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def control_images(dataset: Any, control: str) -> list[Image.Image]:
    """The images to show: the real ones, a white canvas of the same size, or the next item's image."""
    images = list(dataset["image"])
    if control == "blank":
        return [Image.new("RGB", image.size, "white") for image in images]
    if control == "shuffled":
        return images[1:] + images[:1]  # every item gets another item's image
    return images


def partial_path(output: Path) -> Path:
    """Where records go while a run is in progress: `<output>.partial.jsonl`."""
    return output.with_name(output.name + ".partial.jsonl")


def _json_safe(content: dict[str, Any]) -> dict[str, Any]:
    """`content` as it reads back from JSON (tuples become lists), so a header compares equal to its source."""
    return json.loads(json.dumps(content, ensure_ascii=False))


def read_partial(partial: Path, metadata: dict[str, Any]) -> dict[str, dict]:
    """The records of an interrupted run, by id; refused if that run had other settings.

    A line cut by a kill is incomplete JSON: it is dropped, and its example is evaluated again.
    """
    entries = []
    for line in partial.read_text(encoding="utf-8").splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not entries:
        return {}
    header, *records = entries
    if "metadata" not in header:
        raise ValueError(f"{partial} does not start with the settings header of an evaluation; delete it")
    current = _json_safe(metadata)
    differing = sorted(
        key
        for key in set(header["metadata"]) | set(current)
        if key not in RESUME_FREE_KEYS and header["metadata"].get(key) != current.get(key)
    )
    if differing:
        raise ValueError(
            f"cannot resume: {partial} was written with other settings ({', '.join(differing)}); "
            "run without --resume to start over"
        )
    return {record["id"]: record for record in records}


def write_partial(partial: Path, metadata: dict[str, Any], records: Iterable[dict[str, Any]]) -> None:
    """Start the partial file: the settings header, then `records` (those kept from an interrupted run)."""
    lines = [{"metadata": metadata}, *records]
    write_text_atomic(partial, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


def run_evaluation(
    evaluator: Evaluator,
    dataset: Any,
    eval_args: EvalArguments,
    max_new_tokens: int,
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """Evaluate `dataset`, appending records to the partial file; write and return the final result."""
    ids = list(dataset["id"])
    if len(set(ids)) != len(ids):
        raise ValueError("the dataset has duplicate ids: records could not be told apart or resumed")
    output = Path(eval_args.output)
    partial = partial_path(output)
    done: dict[str, dict] = {}
    if eval_args.resume and partial.exists():
        wanted = set(ids)  # a run resumed with a smaller --limit keeps only its own examples
        done = {row_id: record for row_id, record in read_partial(partial, metadata).items() if row_id in wanted}
        logger.info("resuming: %d of %d examples already done", len(done), len(ids))
    elif eval_args.resume:
        logger.info("nothing to resume (%s does not exist): starting from the first example", partial)
    write_partial(partial, metadata, done.values())
    images = control_images(dataset, eval_args.image_control)
    todo = [i for i, row_id in enumerate(ids) if row_id not in done]
    start = time.perf_counter()
    with partial.open("a", encoding="utf-8") as sink, tqdm(total=len(ids), initial=len(done), desc="eval") as bar:
        for first in range(0, len(todo), eval_args.batch_size):
            batch = todo[first : first + eval_args.batch_size]
            rows = [dataset[i] for i in batch]
            generated = evaluator.generate(rows, [images[i] for i in batch], max_new_tokens)
            for row, result in zip(rows, generated, strict=True):
                record = evaluator.record(row, result)
                done[record["id"]] = record
                sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            sink.flush()
            bar.update(len(batch))
    seconds = time.perf_counter() - start
    # Records go through JSON first, so a resumed run's records and a fresh run's are the same values.
    records = [_json_safe(done[row_id]) for row_id in ids]
    summary = summarize(records)
    summary["total_seconds"] = seconds
    summary["samples_per_s"] = len(todo) / seconds if seconds > 0 and todo else None
    result = {"summary": summary, "metadata": metadata, "records": records}
    write_json_atomic(output, result)
    partial.unlink()
    return result


def write_json_atomic(path: Path, content: dict[str, Any]) -> None:
    """`content` as indented JSON, written atomically."""
    write_text_atomic(path, json.dumps(content, indent=1, ensure_ascii=False))


def build_evaluator(task_args: TaskArguments, train_args: Any, model_args: ModelConfig, eval_args: EvalArguments):
    """Model (+ verified adapter), processor and rewards exactly as the recipe's training run built them."""
    processor = get_processor(model_args, task_args, train_args.trust_remote_code)
    model = load_model(model_args, train_args.trust_remote_code)
    if eval_args.adapter:
        model = load_verified_adapter(model, eval_args.adapter, merge=eval_args.merge_adapter)
    rewards = get_recipe_rewards(task_args, processor.tokenizer)
    evaluator = Evaluator(model, processor, task_args.task, rewards, train_args.chat_template_kwargs or {})
    return evaluator, processor


def default_max_new_tokens(task_args: TaskArguments, train_args: Any) -> int:
    """GeoQA: the seed's 1,024 tokens; shapes: the recipe's training completion length."""
    return GEOQA_MAX_NEW_TOKENS if task_args.task == "geoqa" else train_args.max_completion_length


def describe_dataset(task_args: TaskArguments) -> dict[str, Any]:
    """What identifies the evaluated examples: the generator and seed, or the GeoQA source and revision."""
    if task_args.task == "shapes":
        return {
            "generator": asdict(shape_spec(task_args)),
            "seed": task_args.shapes_eval_seed,
            "size": task_args.shapes_eval_size,
        }
    return {
        "name": task_args.dataset_name,
        "revision": task_args.dataset_revision,
        "test_rows": task_args.geoqa_test_rows,
        "prompt_language": task_args.prompt_language,
    }


def reproducible_argv(argv: list[str]) -> list[str]:
    """The arguments without `--resume [true|false]`: resuming changes how a file is made, not what it holds."""
    kept: list[str] = []
    after_resume = False
    for arg in argv:
        if after_resume and arg.lower() in ("true", "false", "yes", "no", "1", "0"):
            after_resume = False
            continue
        after_resume = arg == "--resume"
        if not (after_resume or arg.startswith("--resume=")):
            kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    task_args, train_args, model_args, eval_args = parse_recipe(
        (TaskArguments, GRPOConfig, ModelConfig, EvalArguments), argv
    )
    # Fail on paths before the (possibly large) model is loaded.
    output = Path(eval_args.output)
    if not output.parent.is_dir():
        raise FileNotFoundError(f"output folder {output.parent} does not exist: create it or choose another --output")
    if eval_args.adapter:
        check_adapter_dir(eval_args.adapter)
    torch.manual_seed(SEED)
    evaluator, processor = build_evaluator(task_args, train_args, model_args, eval_args)
    dataset = get_dataset(task_args, "eval", max_pixels_of(processor))
    if eval_args.limit:
        dataset = dataset.select(range(min(eval_args.limit, len(dataset))))
    max_new_tokens = eval_args.max_new_tokens or default_max_new_tokens(task_args, train_args)
    metadata = {
        "recipe": recipe_path_of(argv),
        "argv": reproducible_argv(argv),
        "task": task_args.task,
        "model": model_args.model_name_or_path,
        "adapter": eval_args.adapter,
        "adapter_base": adapter_base_model(eval_args.adapter) if eval_args.adapter else None,
        "merged": eval_args.merge_adapter and eval_args.adapter is not None,
        "dataset": describe_dataset(task_args),
        "dataset_revision": task_args.dataset_revision,
        "max_pixels": max_pixels_of(processor),
        "chat_template_kwargs": train_args.chat_template_kwargs or {},
        "image_control": eval_args.image_control,
        "max_new_tokens": max_new_tokens,
        "batch_size": eval_args.batch_size,
        "decoding": "greedy",
        "seed": SEED,
        "packages": package_versions(),
    }
    return run_evaluation(evaluator, dataset, eval_args, max_new_tokens, metadata)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(main()["summary"], indent=1, ensure_ascii=False))
