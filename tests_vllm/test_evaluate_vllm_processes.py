"""`eval/evaluate.py --backend vllm` on two processes (torchrun, gloo on CPU): one engine per rank, each generating
its share of the rows, merged as the HF backend merges them, or one engine sharded over both
(`--tensor_parallel_size 2`): the records of a one-process run either way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import RECIPE, check, run_python

COMMON = ["eval/evaluate.py", "--config", RECIPE, "--limit", "6", "--max_new_tokens", "8", "--batch_size", "2"]
TORCHRUN = ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
# name: (launcher, evaluation flags)
RUNS = {"1": ([], []), "2": (TORCHRUN, []), "2, tp 2": (TORCHRUN, ["--tensor_parallel_size", "2"])}


@pytest.fixture(scope="module")
def results(replica, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("eval")
    out = {}
    for name, (launch, flags) in RUNS.items():
        output = root / f"{name}.json"
        check(run_python([*launch, *COMMON, *flags, "--backend", "vllm", "--output", str(output)], timeout=900))
        out[name] = json.loads(output.read_text())
    return out


def test_two_vllm_processes_give_the_one_process_records(results) -> None:
    assert results["2"]["metadata"]["num_processes"] == 2, "torchrun did not start two processes"
    assert results["1"]["metadata"]["num_processes"] == 1
    assert len(results["1"]["records"]) == 6
    assert results["2"]["records"] == results["1"]["records"]


def test_one_engine_sharded_over_two_processes_gives_the_one_process_records(results) -> None:
    sharded = results["2, tp 2"]
    # metadata.tensor_parallel_size is the engine's own parallel config: one engine of 2 shards, not two engines
    assert sharded["metadata"]["num_processes"] == 2 and sharded["metadata"]["tensor_parallel_size"] == 2
    assert results["2"]["metadata"]["tensor_parallel_size"] == 1
    assert [r["id"] for r in sharded["records"]] == [r["id"] for r in results["1"]["records"]]
    assert sharded["records"] == results["1"]["records"]


def test_a_sharded_engine_leaves_no_shared_memory_names_behind(results) -> None:
    # vLLM's CPU communicator names its segments the same in every `external_launcher` run and creates them
    # exclusively: one left behind fails every later tensor-parallel launch on the machine (errno 17)
    assert not sorted(Path("/dev/shm").glob("*-cpushm_*"))
