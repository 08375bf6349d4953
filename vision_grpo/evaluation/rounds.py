"""Greedy records for batches of a split, shared across the processes of a launch: `eval/evaluate.py` and the
held-out curve during training both generate through `generated_records`, so a launch of N processes evaluates a
split in about 1/N of the time and gets the same records as one process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from accelerate import PartialState
from accelerate.utils import gather_object

from vision_grpo.evaluation.batches import read_batch
from vision_grpo.evaluation.evaluator import Evaluator


def batches_of_rank(batches: Sequence[list[int]], rank: int, world: int) -> list[list[int]]:
    """Process `rank`'s batch in each round: round r gives process p `batches[r * world + p]`, or an empty batch where
    none is left. Every process gets one entry per round, so all of them reach every round's gather."""
    return [batches[first + rank] if first + rank < len(batches) else [] for first in range(0, len(batches), world)]


def generated_records(
    evaluator: Evaluator, dataset: Any, batches: Sequence[list[int]], max_new_tokens: int, control: str = "none"
) -> Iterator[list[dict[str, Any]]]:
    """Each round's records, on every process, in batch order: every process generates its own batch of the round
    (`batches_of_rank`) and the records are gathered, so the concatenated rounds are the records of `batches` in
    order, whatever the number of processes. The batches themselves do not depend on it, so neither does the padding
    a row is generated with.

    Processes that share one engine (`evaluator.tensor_parallel_size` consecutive ranks) generate the same batch
    together, and only the first of them reports its records, so each batch is gathered once."""
    state = PartialState()
    group = evaluator.tensor_parallel_size
    for mine in batches_of_rank(batches, state.process_index // group, state.num_processes // group):
        rows, images = read_batch(dataset, mine, control)
        generated = evaluator.generate(rows, images, max_new_tokens)
        records = [evaluator.record(row, result) for row, result in zip(rows, generated, strict=True)]
        if state.process_index % group:
            records = []
        yield gather_object(records) if state.num_processes > 1 else records
