"""Evaluate a base model, a trained model or a saved adapter with the recipe it was trained with.

    python eval/evaluate.py --config recipes/geoqa/qwen3_5_4b_lora.yaml --output results/base.json
    python eval/evaluate.py --config recipes/geoqa/qwen3_5_4b_lora.yaml \\
        --adapter runs/geoqa/qwen3_5_4b_lora/<run>/checkpoint-100 --output results/step100.json

    accelerate launch eval/evaluate.py --config ...     # the items split across the processes (GPUs)

The model, prompt, pixel limits and chat-template switches come from the recipe (any key can be overridden on the
command line), and the examples come from the same `get_dataset` as training: the held-out split (`eval`) of the
task. The model goes to the GPU (or MPS) when there is one, in the recipe's dtype. Decoding is greedy with a
generation config of our own (nothing from the checkpoint's `generation_config.json`), recorded in the result, in
batches of prompts of similar length, left-padded; answers do not depend on the batch size or the number of
processes. Records are appended to `<output>.partial.jsonl` as they finish (after a header line holding the run's
settings, the model's and adapter's weights by content among them), so `--resume` continues an interrupted run with
the same settings and weights; the final JSON is written atomically. One evaluation at a time writes an output (a
lock, `<output>.lock`), and an existing result or partial file is never replaced without `--overwrite`.
"""

from __future__ import annotations

import vision_grpo.launched  # first: a launcher killed while the imports below run stops this worker too

# isort: split
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from trl import GRPOConfig, ModelConfig

from vision_grpo.config import TaskArguments, parse_recipe, recipe_path_of
from vision_grpo.data import get_dataset
from vision_grpo.eval.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_base_model, check_adapter_dir
from vision_grpo.eval.scoring import summarize
from vision_grpo.evaluator import SEED, Evaluator, build_evaluator, chunks, default_max_new_tokens, read_batch
from vision_grpo.modeling import max_pixels_of
from vision_grpo.recipe_run import decided_by_main_process, from_main_process
from vision_grpo.runs import (
    content_digest,
    dataset_identity,
    hold_lock,
    model_identity,
    package_versions,
    write_text_atomic,
)
from vision_grpo.threads import configure_threads

logger = logging.getLogger("vision_grpo.evaluate")
IMAGE_CONTROLS = ("none", "blank", "shuffled")
BACKENDS = ("hf", "vllm")
TIMING_KEYS = ("samples_per_s", "total_seconds")
# Settings an interrupted run may be resumed with changed: they do not change any record.
RESUME_FREE_KEYS = ("argv", "batch_size", "num_processes")


@dataclass
class EvalArguments:
    """Evaluation options; everything else (model, data, prompt, pixels) comes from the recipe."""

    output: str = field(default="results/eval.json", metadata={"help": "Result JSON (written atomically)."})
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter or checkpoint folder to apply."})
    merge_adapter: bool = field(
        default=False,
        metadata={"help": "Merge the adapter into the weights (faster; vLLM backend: instead of vLLM's LoRA)."},
    )
    batch_size: int = field(default=8, metadata={"help": "Prompts generated together (left padding)."})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "Default: the recipe's max_completion_length (GeoQA recipes: 1024)."}
    )
    limit: int | None = field(default=None, metadata={"help": "Evaluate only the first N examples."})
    resume: bool = field(default=False, metadata={"help": "Continue from `<output>.partial.jsonl`."})
    overwrite: bool = field(
        default=False, metadata={"help": "Replace an existing `<output>` and drop an interrupted run's records."}
    )
    image_control: str = field(
        default="none", metadata={"help": "`none`, `blank` (white canvas) or `shuffled` (another item's image)."}
    )
    bucket_by_length: bool = field(
        default=True, metadata={"help": "Batch prompts of similar length (less padding); false: dataset order."}
    )
    device_map: str | None = field(
        default=None,
        metadata={"help": "`auto`: spread a model too large for one GPU over all (one process). Default: one device."},
    )
    backend: str = field(
        default="hf",
        metadata={"help": "`hf` (transformers generate) or `vllm` (needs vLLM): the same prompts, records, summary."},
    )

    def __post_init__(self) -> None:
        if self.image_control not in IMAGE_CONTROLS:
            raise ValueError(f"image_control must be one of {IMAGE_CONTROLS}, got {self.image_control!r}")
        for name in ("batch_size", "max_new_tokens", "limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.device_map not in (None, "auto"):
            raise ValueError(f"device_map must be `auto` or unset, got {self.device_map!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.resume and self.overwrite:
            raise ValueError("--resume keeps an interrupted run's records and --overwrite drops them: pass one")


class OutputConflict(ValueError):
    """An output another evaluation is writing, or one that holds results this run would replace or mix with."""


def partial_path(output: Path) -> Path:
    """Where records go while a run is in progress: `<output>.partial.jsonl`."""
    return output.with_name(output.name + ".partial.jsonl")


def _json_safe(content: dict[str, Any]) -> dict[str, Any]:
    """`content` as it reads back from JSON (tuples become lists), so a header compares equal to its source."""
    return json.loads(json.dumps(content, ensure_ascii=False))


def partial_entries(partial: Path) -> list[dict[str, Any]]:
    """The header and records of a partial file, line by line.

    A line cut by a kill or a full disk is incomplete JSON, possibly ending inside a multi-byte character: each
    line is decoded on its own, so such a line is dropped (its example is evaluated again) and the rest is kept.
    """
    entries = []
    for line in partial.read_bytes().splitlines():
        try:
            entries.append(json.loads(line.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
    return entries


def read_partial(partial: Path, metadata: dict[str, Any], known_only: bool = False) -> dict[str, dict]:
    """The records of an interrupted run, by id; refused if that run had other settings.

    Compared are the header's keys and `metadata`'s (only `metadata`'s with `known_only`: before the model loads,
    some are not known yet), except those that change no record (`RESUME_FREE_KEYS`).
    """
    entries = partial_entries(partial)
    if not entries:
        return {}
    header, *records = entries
    if "metadata" not in header:
        raise OutputConflict(
            f"{partial} does not start with the settings header of an evaluation: pass --overwrite to start over"
        )
    then, now = header["metadata"], _json_safe(metadata)
    differing = [
        f"{key}: {then.get(key)!r} then, {now.get(key)!r} now"
        for key in sorted(set(now) if known_only else set(then) | set(now))
        if key not in RESUME_FREE_KEYS and then.get(key) != now.get(key)
    ]
    if differing:
        raise OutputConflict(
            f"cannot resume: {partial} was written with other settings or weights ({'; '.join(differing)}); "
            "pass --overwrite to start over, or choose another --output"
        )
    return {record["id"]: record for record in records}


def hold_output(output: Path) -> AbstractContextManager[None]:
    """Hold `<output>.lock` while the block runs: a second evaluation of the same output fails at once, naming the
    process that holds it, instead of deleting or mixing into this one's files (the run folders' lock)."""
    return hold_lock(
        output.with_name(output.name + ".lock"),
        lambda holder: OutputConflict(
            f"another evaluation (pid {holder}) is writing {output}: wait for it to end or choose another --output"
        ),
    )


def check_output(eval_args: EvalArguments) -> None:
    """Refuse to replace a finished result, or an interrupted run's records, without `--overwrite`."""
    output = Path(eval_args.output)
    partial = partial_path(output)
    if eval_args.overwrite:
        return
    if output.exists():
        raise OutputConflict(
            f"{output} already holds a result: pass --overwrite to replace it, or choose another --output"
        )
    if partial.exists() and not eval_args.resume:
        held = max(len(partial_entries(partial)) - 1, 0)
        raise OutputConflict(
            f"{partial} holds {held} record(s) of an interrupted evaluation: pass --resume to continue it, "
            "--overwrite to start over, or choose another --output"
        )


def claim_output(
    eval_args: EvalArguments, model_args: ModelConfig, settings: dict[str, Any], stack: ExitStack
) -> dict[str, Any]:
    """Before any model loads: lock the output (held until `stack` closes), refuse what this run would replace,
    identify the weights (a large model is hashed only once the output is this run's) and refuse a resume with other
    settings or weights. The main process decides; returns `settings` with the weights' identity, on every process."""

    def claim() -> None:
        stack.enter_context(hold_output(Path(eval_args.output)))
        check_output(eval_args)
        if PartialState().num_processes > 1:  # named, so that a rank timing out in the broadcast can be explained
            logger.info(
                "identifying %s by content (sha256 of its weights: read in full once, then remembered); the other "
                "processes wait for it under ddp_timeout",
                model_args.model_name_or_path,
            )
        settings.update(weights_identity(model_args, eval_args.adapter))
        partial = partial_path(Path(eval_args.output))
        if eval_args.resume and partial.exists():
            read_partial(partial, settings, known_only=True)

    decided_by_main_process(claim)
    return from_main_process(settings)


def weights_identity(model_args: ModelConfig, adapter: str | None) -> dict[str, Any]:
    """The model and adapter by content (`model_identity`; sha256 of the adapter's files): a resume then refuses
    other weights under the same path."""
    return {
        "model_weights": model_identity(model_args.model_name_or_path, model_args.model_revision),
        "adapter_weights": content_digest([Path(adapter) / ADAPTER_WEIGHTS, Path(adapter) / ADAPTER_CONFIG])
        if adapter
        else None,
    }


def write_partial(partial: Path, metadata: dict[str, Any], records: Iterable[dict[str, Any]]) -> None:
    """Start the partial file: the settings header, then `records` (those kept from an interrupted run)."""
    lines = [{"metadata": metadata}, *records]
    write_text_atomic(partial, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


def by_prompt_length(evaluator: Evaluator, dataset: Any, todo: list[int], batch_size: int) -> list[int]:
    """`todo`, shortest rendered prompt first (ties in item order): batches with little padding.

    The lengths are counted a batch of rows at a time, each process a share of them, then gathered: every process
    gets the same order, and no process holds more than one batch of decoded images.
    """
    state = PartialState()
    lengths = []
    for indices in chunks(todo[state.process_index :: state.num_processes], batch_size):
        rows, images = read_batch(dataset, indices)
        lengths += [
            (evaluator.prompt_length(row, image), i) for i, row, image in zip(indices, rows, images, strict=True)
        ]
    if state.num_processes > 1:
        lengths = gather_object(lengths)
    return [i for _, i in sorted(lengths)]


def run_evaluation(
    evaluator: Evaluator,
    dataset: Any,
    eval_args: EvalArguments,
    max_new_tokens: int,
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """Evaluate `dataset`, appending records to the partial file; write and return the final result.

    Rows are read and their images decoded one batch at a time, as the batch is generated (controls built from the
    batch), so memory holds the records and one batch, whatever the size of the split. With several processes
    (`accelerate launch`), each round gives every process its own batch; a process with no batch left in the last
    round still takes part in the round's gather and adds nothing. The main process appends the round's records to
    the one partial file and writes the one result, in item order.
    """
    state = PartialState()
    ids = list(dataset["id"])
    if len(set(ids)) != len(ids):
        raise ValueError("the dataset has duplicate ids: records could not be told apart or resumed")
    output = Path(eval_args.output)
    partial = partial_path(output)
    done: dict[str, dict] = {}
    if state.is_main_process:
        if eval_args.resume and partial.exists():
            wanted = set(ids)  # a run resumed with a smaller --limit keeps only its own examples
            done = {row_id: record for row_id, record in read_partial(partial, metadata).items() if row_id in wanted}
            logger.info("resuming: %d of %d examples already done", len(done), len(ids))
        elif eval_args.resume:
            logger.info("nothing to resume (%s does not exist): starting from the first example", partial)
        write_partial(partial, metadata, done.values())
    done = from_main_process(done)
    start = time.perf_counter()  # samples/s includes the bucketing's own cost (one more render per item)
    todo = [i for i, row_id in enumerate(ids) if row_id not in done]
    if eval_args.bucket_by_length:
        todo = by_prompt_length(evaluator, dataset, todo, eval_args.batch_size)
    batches = chunks(todo, eval_args.batch_size)
    world, rank = state.num_processes, state.process_index
    sink = partial.open("a", encoding="utf-8") if state.is_main_process else nullcontext()
    bar = tqdm(total=len(ids), initial=len(done), desc="eval", disable=not state.is_main_process)
    with sink, bar:
        for first in range(0, len(batches), world):
            mine = batches[first + rank] if first + rank < len(batches) else []
            rows, images = read_batch(dataset, mine, eval_args.image_control)
            generated = evaluator.generate(rows, images, max_new_tokens)
            records = [evaluator.record(row, result) for row, result in zip(rows, generated, strict=True)]
            if world > 1:
                records = gather_object(records)
            for record in records:
                done[record["id"]] = record
                if state.is_main_process:
                    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            if state.is_main_process:
                sink.flush()
            bar.update(len(records))
    seconds = time.perf_counter() - start
    # Records go through JSON first, so a resumed run's records and a fresh run's are the same values.
    records = [_json_safe(done[row_id]) for row_id in ids]
    summary = summarize(records)
    summary["total_seconds"] = seconds
    summary["samples_per_s"] = len(todo) / seconds if seconds > 0 and todo else None
    result = {"summary": summary, "metadata": metadata, "records": records}
    if state.is_main_process:
        write_json_atomic(output, result)
        partial.unlink()
    state.wait_for_everyone()
    return result


def write_json_atomic(path: Path, content: dict[str, Any]) -> None:
    """`content` as indented JSON, written atomically."""
    write_text_atomic(path, json.dumps(content, indent=1, ensure_ascii=False))


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
    # Fail on paths, the output's owner and a resume's settings before the (possibly large) model is loaded.
    output = Path(eval_args.output)
    if not output.parent.is_dir():
        raise FileNotFoundError(f"output folder {output.parent} does not exist: create it or choose another --output")
    if not os.access(output.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"output folder {output.parent} is not writable: choose another --output")
    if eval_args.adapter:
        check_adapter_dir(eval_args.adapter)
        if eval_args.backend == "vllm" and not eval_args.merge_adapter:
            from vision_grpo.eval.vllm_backend import check_vllm_lora  # imports no vLLM: refused before it loads

            check_vllm_lora(eval_args.adapter)
    configure_threads()
    state = PartialState()
    if eval_args.backend == "vllm" and state.num_processes > 1:
        raise ValueError(
            f"--backend vllm runs one engine in one process, and this is process {state.process_index} of "
            f"{state.num_processes} (accelerate launch or torchrun): an engine per rank would each hold a whole "
            f"model with default memory use. Start it as one process: python eval/evaluate.py {shlex.join(argv)}"
        )
    max_new_tokens = eval_args.max_new_tokens or default_max_new_tokens(task_args, train_args)
    settings = {
        "recipe": recipe_path_of(argv),
        "argv": reproducible_argv(argv),
        "task": task_args.task,
        "model": model_args.model_name_or_path,
        "adapter": eval_args.adapter,
        "adapter_base": adapter_base_model(eval_args.adapter) if eval_args.adapter else None,
        "merged": eval_args.merge_adapter and eval_args.adapter is not None,
        "dataset": dataset_identity(task_args),
        "dataset_revision": task_args.dataset_revision,
        "chat_template_kwargs": train_args.chat_template_kwargs or {},
        "image_control": eval_args.image_control,
        "max_new_tokens": max_new_tokens,
        "batch_size": eval_args.batch_size,
        "num_processes": state.num_processes,
        "decoding": "greedy",
        "backend": eval_args.backend,
        "seed": SEED,
        "packages": package_versions(),
    }
    with ExitStack() as held:
        settings = claim_output(eval_args, model_args, settings, held)
        torch.manual_seed(SEED)
        evaluator, processor = build_evaluator(task_args, train_args, model_args, eval_args)
        dataset = get_dataset(task_args, "eval", max_pixels_of(processor))
        if eval_args.limit:
            dataset = dataset.select(range(min(eval_args.limit, len(dataset))))
        metadata = {
            **settings,
            "max_pixels": max_pixels_of(processor),
            "generation_config": evaluator.decoding(max_new_tokens),
            **evaluator.placement(),
        }
        result = run_evaluation(evaluator, dataset, eval_args, max_new_tokens, metadata)
    if state.num_processes > 1:
        state.destroy_process_group()  # leave together (see RecipeRun.train_and_save)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with vision_grpo.launched.errors_named_first():
        summary = main()["summary"]
    if PartialState().is_main_process:
        print(json.dumps(summary, indent=1, ensure_ascii=False))
