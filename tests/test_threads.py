"""The entry points' torch thread default when `OMP_NUM_THREADS` is unset (vision_grpo/run/threads.py)."""

from __future__ import annotations

import os

import pytest
import torch

from vision_grpo.run import threads


@pytest.mark.parametrize(
    ("cores", "local_processes", "expected"),
    [(2, None, 1), (1, None, 1), (4, None, 2), (64, None, 62), (64, "8", 6), (16, "8", 1)],
)
def test_default_threads(monkeypatch: pytest.MonkeyPatch, cores: int, local_processes: str | None, expected: int):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    if local_processes is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_processes)
    assert threads.default_threads() == expected


def test_the_default_applies_only_without_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        monkeypatch.setattr(threads, "default_threads", lambda: 5)
        assert threads.configure_threads() == before  # the user's choice: torch already follows it
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert threads.configure_threads() == 5 == torch.get_num_threads()
        assert os.environ["OMP_NUM_THREADS"] == "5"  # processes started from here follow it too
    finally:
        torch.set_num_threads(before)
