"""An evaluation's files: the result JSON (written atomically), the partial file its records are appended to while
it runs (a settings header first, so `--resume` continues only a run with the same settings and weights), and the
output's lock; nothing is replaced without `--overwrite`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

from accelerate import PartialState
from trl import ModelConfig

from vision_grpo.evaluation.adapters import adapter_digest
from vision_grpo.evaluation.eval_options import EvalArguments
from vision_grpo.recipe.parse import recipe_path_of
from vision_grpo.run.locks_and_digests import hold_lock
from vision_grpo.run.manifest import model_identity
from vision_grpo.run.ranks import decided_by_main_process, from_main_process
from vision_grpo.storage.writes import write_text_atomic

logger = logging.getLogger("vision_grpo.evaluate")


# Settings an interrupted run may be resumed with changed: they do not change any record.
RESUME_FREE_KEYS = ("argv", "batch_size", "num_processes")


class OutputConflict(ValueError):
    """An output another evaluation is writing, or one that holds results this run would replace or mix with."""


def partial_path(output: Path) -> Path:
    """Where records go while a run is in progress: `<output>.partial.jsonl`."""
    return output.with_name(output.name + ".partial.jsonl")


def json_safe(content: dict[str, Any]) -> dict[str, Any]:
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
    then, now = header["metadata"], json_safe(metadata)
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


def not_a_result(path: Path) -> str | None:
    """Why the existing file at `path` is not a result (JSON with `summary` and `records`, as eval/compare.py reads
    results), or None. Of a file that does not start as JSON does only one byte is read: weights are not read in full.
    """
    with path.open("rb") as source:
        if source.read(1) != b"{":
            return "not JSON"
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"not JSON: {error}"
    if not isinstance(content, dict) or not {"summary", "records"} <= content.keys():
        return "JSON without summary and records"
    return None


def check_replaceable(output: Path) -> None:
    """An output may replace only an earlier result: never a folder or a file of any other kind, with or without
    `--overwrite` (which is meant for results; a typo must not turn it onto a recipe or a notes file)."""
    if output.is_dir():
        raise OutputConflict(
            f"--output {output} is a folder: name the result file, e.g. --output {output / 'eval.json'}"
        )
    if output.exists() and (why := not_a_result(output)):
        raise OutputConflict(
            f"--output {output} exists and is not a result of an evaluation ({why}): --overwrite replaces only an "
            "earlier result; choose another --output"
        )


def evaluation_inputs(
    argv: list[str], task_args: Any, model_args: ModelConfig, eval_args: EvalArguments
) -> dict[str, str | None]:
    """What an evaluation (or pass@k) reads from disk, by the flag that names it: its output must be none of them."""
    return {
        "the recipe (--config)": recipe_path_of(argv),
        "the adapter (--adapter)": eval_args.adapter,
        "the model (--model_name_or_path)": model_args.model_name_or_path,
        "the dataset (--dataset_name)": task_args.dataset_name,
    }


def finished_from(partial: Path, output: Path) -> bool:
    """Whether `output` is the finished result of the run whose records `partial` holds (its settings header is the
    result's metadata). A run writes its result and then removes its partial file, so a stop between the two leaves
    both: `--resume` then takes every record from the partial file, evaluates nothing and writes the same result."""
    if not partial.exists():
        return False
    with partial.open("rb") as source:
        first = source.readline()
    try:
        header = json.loads(first.decode("utf-8"))
        return isinstance(header, dict) and header.get("metadata") == json.loads(output.read_bytes())["metadata"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError):
        return False


def check_output(eval_args: EvalArguments) -> None:
    """Refuse to replace anything but a result, and a finished result or an interrupted run's records without
    `--overwrite`."""
    output = Path(eval_args.output)
    partial = partial_path(output)
    check_replaceable(output)
    if eval_args.overwrite:
        return
    if output.exists() and not (eval_args.resume and finished_from(partial, output)):
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
        "adapter_weights": adapter_digest(adapter) if adapter else None,
    }


def write_partial(partial: Path, metadata: dict[str, Any], records: Iterable[dict[str, Any]]) -> None:
    """Start the partial file: the settings header, then `records` (those kept from an interrupted run)."""
    lines = [{"metadata": metadata}, *records]
    write_text_atomic(partial, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


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
