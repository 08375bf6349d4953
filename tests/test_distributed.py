"""Two real processes train the tiny model in lock-step on CPU: plain data parallelism (gloo) and DeepSpeed ZeRO-2,
each started by `accelerate launch` with a shipped accelerate config, exactly as a user starts a GPU run.

What each process did is recorded from inside the run (tests/recording): the prompts it generated for, and the
checksums of its weights after every optimizer step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_script
from recording.recorder import GLOO_ONLY_ENV, RECORD_ENV, TINY_RECIPE, read_records, recorded_training_args
from safetensors.torch import load_file

from vision_grpo.models.embedded import TINY_MODEL, resolve_model_path

# `python rank_clock.py <script> <args>`: the script, with rank r's clock 2 r seconds ahead (as on two machines, or
# two processes that straddle a second), so a run name taken from each rank's own clock names two folders.
RANK_CLOCK = """
import datetime as real
import os
import runpy
import sys

from vision_grpo.run import recipe_run


class RankClock(real.datetime):
    @classmethod
    def now(cls, tz=None):
        return real.datetime.now(tz) + real.timedelta(seconds=2 * int(os.environ["RANK"]))


recipe_run.datetime = RankClock
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def launch_recorded(
    tmp_path: Path, launch: list[str], *overrides: str, env: dict[str, str] | None = None
) -> tuple[Path, Path]:
    """`accelerate launch <launch> train_recorded.py ...` on the tiny recipe (`launch` empty: `python
    train_recorded.py ...`, one process), with `env` added to the environment; returns (run folder, records
    folder)."""
    records, run_dir = tmp_path / "records", tmp_path / "runs" / "run"
    records.mkdir(parents=True)
    launcher = ["-m", "accelerate.commands.launch", *launch] if launch else []
    run_script(
        [*launcher, *recorded_training_args(run_dir, *overrides)],
        timeout=900,
        env={RECORD_ENV: str(records), GLOO_ONLY_ENV: "1", **(env or {})},
    )
    return run_dir, records


def assert_two_processes_in_lock_step(records: Path, distributed_type: str) -> list[dict]:
    """Both ranks ran every step, generated for different prompts, and hold identical weights that moved."""
    steps = read_records(records, "step")
    assert {(s["rank"], s["world_size"]) for s in steps} == {(0, 2), (1, 2)}
    assert {s["distributed_type"] for s in steps} == {f"DistributedType.{distributed_type}"}
    for step in (1, 2):
        at_step = {s["rank"]: s["checksums"]["all"] for s in steps if s["step"] == step}
        assert set(at_step) == {0, 1}, f"step {step} did not run on both ranks"
        assert at_step[0] == at_step[1], f"the ranks' weights differ after step {step}"
    begin = {b["rank"]: b["checksums"] for b in read_records(records, "begin")}
    assert begin[0] == begin[1], "the ranks started from different weights"
    last = [s for s in steps if s["step"] == 2][0]["checksums"]
    assert last["lora"] != begin[0]["lora"], "the adapters did not move: there was no gradient to synchronise"
    assert_ranks_saw_different_prompts(records)
    return steps


def assert_ranks_saw_different_prompts(records: Path) -> None:
    rewarded = {rank: [r["ids"] for r in read_records(records, "rewarded") if r["rank"] == rank] for rank in (0, 1)}
    assert len(rewarded[0]) == len(rewarded[1]) == 2, "each rank scores its own completions once per step"
    for ids_0, ids_1 in zip(rewarded[0], rewarded[1], strict=True):
        assert ids_0 and ids_1
        assert not set(ids_0) & set(ids_1), f"both ranks generated for the same prompts: {ids_0} / {ids_1}"


@pytest.mark.slow
def test_two_cpu_processes_train_in_lock_step_with_the_cpu_config(tmp_path: Path) -> None:
    run_dir, records = launch_recorded(tmp_path, ["--config_file", "accelerate_configs/cpu.yaml"])
    assert_two_processes_in_lock_step(records, "MULTI_CPU")
    assert (run_dir / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_deepspeed_zero2_trains_two_cpu_processes(tmp_path: Path) -> None:
    """The GPU config itself, with the process count and precision a CPU allows; the vision tower's scaled
    learning rate (the GPU recipe's set-up) must survive DeepSpeed's optimizer wrapping."""
    launch = ["--config_file", "accelerate_configs/zero2.yaml", "--num_processes", "2", "--mixed_precision", "no"]
    launch += ["--main_process_port", "0"]
    run_dir, records = launch_recorded(tmp_path, launch, "--lora_on_vision", "true", "--vision_tower", "scaled_lr")
    steps = assert_two_processes_in_lock_step(records, "DEEPSPEED")
    assert {s["optimizer"] for s in steps} == {"DeepSpeedZeroOptimizer"}
    for step in steps:
        vision = {g["lr"] for g in step["param_groups"] if g["vision_tower"]}
        other = {g["lr"] for g in step["param_groups"] if not g["vision_tower"]}
        assert len(vision) == len(other) == 1
        assert vision.pop() == pytest.approx(0.1 * other.pop())
    assert (run_dir / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_deepspeed_zero3_trains_two_cpu_processes_and_saves_whole_adapters(tmp_path: Path) -> None:
    """ZeRO-3 shards the weights themselves, so per-rank checksums prove nothing: the saved adapter must hold
    whole tensors, and trained ones (LoRA's B matrices start at zero). The model cache starts empty, as on a
    user's first run: the embedded model is built inside the launch (built in a ZeRO-3 rank, its collectives
    stalled the other rank)."""
    launch = ["--config_file", "accelerate_configs/zero3.yaml", "--num_processes", "2", "--mixed_precision", "no"]
    empty_cache = {"VISION_GRPO_CACHE": str(tmp_path / "model_cache")}
    run_dir, records = launch_recorded(tmp_path, [*launch, "--main_process_port", "0"], env=empty_cache)
    steps = read_records(records, "step")
    assert {(s["rank"], s["step"]) for s in steps} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    assert {(s["distributed_type"], s["optimizer"]) for s in steps} == {
        ("DistributedType.DEEPSPEED", "DeepSpeedZeroOptimizer_Stage3")
    }
    assert_ranks_saw_different_prompts(records)
    lora_r = yaml.safe_load((REPO / TINY_RECIPE).read_text())["lora_r"]
    adapter = load_file(run_dir / "adapter_model.safetensors")
    assert adapter and all(lora_r in tensor.shape and tensor.numel() > lora_r for tensor in adapter.values())
    assert any(tensor.abs().sum() > 0 for name, tensor in adapter.items() if "lora_B" in name)


# 5 held-out rows in batches of 2 at steps 0, 1 and 2: 3 batches, so on 2 processes rank 1 has none in the last round.
HOLDOUT = ["--holdout_eval_steps", "1", "--holdout_eval_size", "5", "--per_device_eval_batch_size", "2"]


@pytest.mark.slow
def test_two_processes_share_the_holdout_rows_and_log_the_one_process_records(tmp_path: Path) -> None:
    """Rank 0 generates batches 1 and 3 of every held-out measurement and rank 1 batch 2; both get every record, in
    row order, and at step 0 (the same weights) they are the records and metrics of a one-process run. Only rank 0
    logs them."""
    _, one = launch_recorded(tmp_path / "one", [], *HOLDOUT)
    _, two = launch_recorded(tmp_path / "two", ["--config_file", "accelerate_configs/cpu.yaml"], *HOLDOUT)
    ids = [record["id"] for record in read_records(one, "holdout_records")[0]["records"]]
    assert len(ids) == 5
    generated = {
        rank: [e["ids"] for e in read_records(two, "evaluator_generation") if e["rank"] == rank] for rank in (0, 1)
    }
    assert generated[0] == [ids[:2], ids[4:]] * 3, "rank 0 must generate batches 1 and 3 only, at each step"
    assert generated[1] == [ids[2:4], []] * 3, "rank 1 must generate batch 2 and join the last round with none"

    measured = {
        rank: [e["records"] for e in read_records(two, "holdout_records") if e["rank"] == rank] for rank in (0, 1)
    }
    assert len(measured[0]) == 3 and measured[0] == measured[1], "the ranks summarized different records"
    assert all([record["id"] for record in records] == ids for records in measured[0])
    assert measured[0][0] == read_records(one, "holdout_records")[0]["records"]

    def holdout_logs(records: Path) -> dict[tuple[int, int], dict]:
        logs = read_records(records, "log")
        return {(e["rank"], e["step"]): e["logs"] for e in logs if any(k.startswith("holdout/") for k in e["logs"])}

    logged = holdout_logs(two)
    assert set(logged) == {(0, 0), (0, 1), (0, 2)}, "held-out metrics must be logged once a step, by rank 0"
    assert logged[(0, 0)] == holdout_logs(one)[(0, 0)]


def test_the_embedded_model_builds_completely_on_a_rank_other_than_zero(tmp_path: Path, monkeypatch) -> None:
    """Ranks race for the build lock; transformers writes weights only on rank 0, so rank 1 must still build it all."""
    monkeypatch.setenv("VISION_GRPO_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    built = {path.name for path in Path(resolve_model_path(TINY_MODEL)).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= built


def _files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.slow
def test_two_processes_name_one_run_folder_and_a_finished_run_is_left_alone(tmp_path: Path) -> None:
    """No `--run_name`, ranks with different clocks: one folder. Resumed at its last step: says so, changes no byte.
    Resumed with a larger `max_steps`: continues, and the manifest keeps its first start."""
    (tmp_path / "rank_clock.py").write_text(RANK_CLOCK)
    runs = tmp_path / "runs"
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(tmp_path / "rank_clock.py")]
    train = ["recipes/train.py", "--config", TINY_RECIPE, "--output_dir", str(runs), "--save_steps", "1"]
    train += ["--report_to", "none", "--token_check_samples", "1"]
    cpu = {"ACCELERATE_USE_CPU": "1"}
    run_script([*launch, *train, "--max_steps", "2"], env=cpu)
    (run_dir,) = runs.iterdir()
    assert (run_dir / "adapter_model.safetensors").is_file() and (run_dir / "checkpoint-2").is_dir()
    before = _files(run_dir)
    first = json.loads((run_dir / "manifest.json").read_text())
    assert first["global_step"] == first["max_steps"] == 2

    resume = [*train, "--run_name", run_dir.name, "--resume_from_checkpoint", "true"]
    again = run_script([*launch, *resume, "--max_steps", "2"], env=cpu)
    assert "already finished at step 2" in again.stderr
    assert _files(run_dir) == before, "resuming a finished run changed its folder"

    run_script([*launch, *resume, "--max_steps", "3"], env=cpu)
    grown = json.loads((run_dir / "manifest.json").read_text())
    assert grown["global_step"] == 3 and grown["started"] == first["started"]
    assert [r["from"] for r in grown["resumes"]] == [str(run_dir / "checkpoint-2")]
    assert list(runs.iterdir()) == [run_dir]
