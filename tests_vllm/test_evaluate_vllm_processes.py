"""`eval/evaluate.py --backend vllm` on two processes (torchrun, gloo on CPU): one engine per rank, each generating
its share of the rows, merged as the HF backend merges them: the records of a one-process run."""

from __future__ import annotations

import json

import pytest
from conftest import RECIPE, check, run_python

COMMON = ["eval/evaluate.py", "--config", RECIPE, "--limit", "6", "--max_new_tokens", "8", "--batch_size", "2"]
TORCHRUN = ["-m", "torch.distributed.run", "--nproc_per_node", "2"]


@pytest.fixture(scope="module")
def results(replica, tmp_path_factory) -> dict[int, dict]:
    root = tmp_path_factory.mktemp("eval")
    out = {}
    for processes, launch in ((1, []), (2, TORCHRUN)):
        output = root / f"{processes}.json"
        check(run_python([*launch, *COMMON, "--backend", "vllm", "--output", str(output)], timeout=900))
        out[processes] = json.loads(output.read_text())
    return out


def test_two_vllm_processes_give_the_one_process_records(results) -> None:
    assert results[2]["metadata"]["num_processes"] == 2, "torchrun did not start two processes"
    assert results[1]["metadata"]["num_processes"] == 1
    assert len(results[1]["records"]) == 6
    assert results[2]["records"] == results[1]["records"]
