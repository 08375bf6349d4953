"""The split of a split's batches across the processes of a launch (vision_grpo/evaluation/rounds.py), shared by
`eval/evaluate.py` and the held-out curve during training."""

from __future__ import annotations

import pytest

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
