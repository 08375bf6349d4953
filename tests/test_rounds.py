"""The split of a split's batches across the processes of a launch (vision_grpo/evaluation/rounds.py), shared by
`eval/evaluate.py` and the held-out curve during training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vision_grpo.evaluation import rounds
from vision_grpo.evaluation.rounds import batches_of_rank


def test_three_batches_on_two_processes_leave_rank_1_an_empty_last_round() -> None:
    batches = [[0, 1], [2, 3], [4]]
    assert batches_of_rank(batches, 0, 2) == [[0, 1], [4]]
    assert batches_of_rank(batches, 1, 2) == [[2, 3], []]


def test_fewer_batches_than_processes_still_give_every_process_the_round() -> None:
    assert [batches_of_rank([[0]], rank, 4) for rank in range(4)] == [[[0]], [[]], [[]], [[]]]


@pytest.mark.parametrize(("count", "world"), [(0, 2), (1, 1), (1, 3), (4, 4), (5, 2), (13, 3), (7, 8)])
def test_each_round_gathered_in_rank_order_is_the_batches_in_order(count: int, world: int) -> None:
    """Every process has one batch per round (so all reach every gather), each batch is generated once, and the
    gathers (rank 0's records first) concatenate to the batches in their own order."""
    batches = [[2 * i, 2 * i + 1] for i in range(count)]
    shares = [batches_of_rank(batches, rank, world) for rank in range(world)]
    rounds = -(-count // world)
    assert all(len(share) == rounds for share in shares)
    gathered = [index for r in range(rounds) for share in shares for index in share[r]]
    assert gathered == [index for batch in batches for index in batch]


class _Engine:
    """An evaluator stand-in that notes the ids it generates; its record is the row's id."""

    def __init__(self, tensor_parallel_size: int) -> None:
        self.tensor_parallel_size = tensor_parallel_size
        self.generated: list[list[int]] = []

    def generate(self, rows: list[dict], images: list, max_new_tokens: int) -> list[dict]:
        self.generated.append([row["id"] for row in rows])
        return [{} for _ in rows]

    def record(self, row: dict, generated: dict) -> int:
        return row["id"]


@pytest.mark.parametrize(("count", "world", "group"), [(3, 2, 2), (5, 4, 2), (7, 6, 3), (4, 2, 1)])
def test_ranks_sharing_an_engine_generate_together_and_report_once(
    count: int, world: int, group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each group of `group` ranks generates the same batch in a round, only its first rank reports, and the
    gathers in rank order are every batch once, in order."""
    batches = [[2 * i, 2 * i + 1] for i in range(count)]
    monkeypatch.setattr(rounds, "read_batch", lambda dataset, indices, control: ([{"id": i} for i in indices], indices))
    monkeypatch.setattr(rounds, "gather_object", lambda records: records)  # one rank's share; gathered below
    generated, reported = [], []
    for rank in range(world):
        state = SimpleNamespace(process_index=rank, num_processes=world)
        monkeypatch.setattr(rounds, "PartialState", lambda state=state: state)
        engine = _Engine(group)
        reported.append(list(rounds.generated_records(engine, None, batches, 8)))
        generated.append(engine.generated)
    assert all(generated[rank] == generated[rank - rank % group] for rank in range(world)), "a group split a batch"
    assert all(not any(reported[rank]) for rank in range(world) if rank % group), "a second rank of a group reported"
    merged = [i for r in range(len(reported[0])) for share in reported for i in share[r]]
    assert merged == [i for batch in batches for i in batch]
