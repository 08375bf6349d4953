"""The command behind `eval/evaluate.py`: the recipe parsed with the evaluation's options, every check that can
fail before the model loads, then the evaluation itself, batch by batch (across the processes of a launch), its
records appended to the partial file, the result written at the end. See eval/evaluate.py for what it does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from trl import GRPOConfig, ModelConfig, SFTConfig

from vision_grpo.data import get_rows
from vision_grpo.evaluation.adapters import adapter_base_model, check_adapter_dir, check_not_in_model
from vision_grpo.evaluation.backends import build_evaluator
from vision_grpo.evaluation.batches import chunks, read_batch
from vision_grpo.evaluation.eval_options import EvalArguments
from vision_grpo.evaluation.evaluator import SEED, Evaluator, default_max_new_tokens
from vision_grpo.evaluation.results import (
    claim_output,
    evaluation_inputs,
    json_safe,
    partial_path,
    read_partial,
    reproducible_argv,
    write_json_atomic,
    write_partial,
)
from vision_grpo.evaluation.rounds import generated_records
from vision_grpo.evaluation.scoring import summarize
from vision_grpo.models.loading import max_pixels_of
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe, recipe_path_of
from vision_grpo.run.manifest import dataset_identity, package_versions
from vision_grpo.run.outputs import check_outputs_are_not_inputs
from vision_grpo.run.rank_watch import watch_ranks
from vision_grpo.run.ranks import from_main_process
from vision_grpo.run.threads import configure_threads
from vision_grpo.storage.writes import append_bytes

logger = logging.getLogger("vision_grpo.evaluate")
TIMING_KEYS = ("samples_per_s", "total_seconds")


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
    bar = tqdm(total=len(ids), initial=len(done), desc="eval", disable=not state.is_main_process)
    with bar:
        for records in generated_records(evaluator, dataset, batches, max_new_tokens, eval_args.image_control):
            for record in records:
                done[record["id"]] = record
            if state.is_main_process:  # one write a round: a full disk keeps every earlier round's records whole
                lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
                append_bytes(partial, lines.encode("utf-8"))
            bar.update(len(records))
    seconds = time.perf_counter() - start
    # Records go through JSON first, so a resumed run's records and a fresh run's are the same values.
    records = [json_safe(done[row_id]) for row_id in ids]
    summary = summarize(records)
    summary["total_seconds"] = seconds
    summary["samples_per_s"] = len(todo) / seconds if seconds > 0 and todo else None
    result = {"summary": summary, "metadata": metadata, "records": records}
    if state.is_main_process:
        write_json_atomic(output, result)
        partial.unlink()
    state.wait_for_everyone()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    task_args, train_args, model_args, eval_args = parse_recipe(
        (TaskArguments, GRPOConfig, ModelConfig, EvalArguments), argv, also_read_by=(SFTConfig,)
    )
    if eval_args.write_held_out:
        from vision_grpo.evaluation.outside_evaluators import write_held_out  # pyarrow writer, only for this

        folder = Path(eval_args.write_held_out)
        return {"summary": write_held_out(folder, task_args, train_args, model_args, eval_args)}
    # Fail on paths, the output's owner and a resume's settings before the (possibly large) model is loaded.
    output = Path(eval_args.output)
    if not output.parent.is_dir():
        raise FileNotFoundError(f"output folder {output.parent} does not exist: create it or choose another --output")
    if not os.access(output.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"output folder {output.parent} is not writable: choose another --output")
    check_outputs_are_not_inputs(
        "--output", [output, partial_path(output)], evaluation_inputs(argv, task_args, model_args, eval_args)
    )
    if eval_args.adapter:
        check_adapter_dir(eval_args.adapter)
        check_not_in_model(model_args.model_name_or_path, eval_args.adapter)
        if eval_args.backend == "vllm" and not eval_args.merge_adapter:
            from vision_grpo.evaluation.vllm_backend import check_vllm_lora  # imports no vLLM: refused before it loads

            check_vllm_lora(eval_args.adapter)
    configure_threads()
    state = PartialState()
    # A rank that stops answering ends the launch within rank_stall_timeout, naming it (as in training): the others
    # would otherwise wait in the next round's gather for the process group's timeout.
    watch = watch_ranks(task_args.rank_stall_timeout, resume="--resume")
    if eval_args.backend == "vllm":
        from vision_grpo.evaluation.vllm_backend import check_tensor_parallel  # imports no vLLM

        check_tensor_parallel(eval_args.tensor_parallel_size, state.num_processes)
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
        "tensor_parallel_size": eval_args.tensor_parallel_size,
        "seed": SEED,
        "packages": package_versions(),
    }
    with ExitStack() as held:
        settings = claim_output(eval_args, model_args, settings, held)
        torch.manual_seed(SEED)
        evaluator, processor = build_evaluator(task_args, train_args, model_args, eval_args)
        held.callback(evaluator.close)  # after the evaluation's last collective, before the output's lock goes
        if watch is not None:  # stopped first: a rank that leaves first (its engine closed) has not stalled
            held.callback(watch.stop)
        rows = get_rows(task_args, "eval", max_pixels_of(processor))
        dataset = rows.dataset
        if eval_args.limit:
            dataset = dataset.select(range(min(eval_args.limit, len(dataset))))
        metadata = {
            **settings,
            # Rows of the split not evaluated, by reason (`skip_bad_rows`: invalid rows skipped), as a training
            # run's manifest records them: an accuracy over fewer rows than the split holds says so in its file.
            "rows_unused": rows.unused,
            "rows_unused_ids": rows.unused_ids,
            "max_pixels": max_pixels_of(processor),
            "generation_config": evaluator.decoding(max_new_tokens),
            **evaluator.placement(),
        }
        result = run_evaluation(evaluator, dataset, eval_args, max_new_tokens, metadata)
    if torch.distributed.is_initialized():  # a vLLM engine's shutdown has closed it already
        state.destroy_process_group()  # leave together (see RecipeRun.close)
    return result
