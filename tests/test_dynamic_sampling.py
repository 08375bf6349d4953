"""Dynamic sampling (vision_grpo/training/dynamic_sampling.py): groups without signal replaced by groups with signal
from further rounds, the rows of several rounds joined into one batch, the same decision on every rank, and a run
killed after a checkpoint that resumes with the prompts and the weights of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import run_script
from safetensors.torch import load_file
from test_resume import probe_plugin

from vision_grpo.training.dynamic_sampling import join_rows, live_groups

# Rewards with signal only for prompts whose id hashes odd (about half the groups); every call logged as (step,
# ids, process) to PROBE_LOG; the process SIGKILLed at step PROBE_KILL_AT_STEP.
PROBE = probe_plugin(
    "ds_probe",
    "[float(len(t) % 3 == 0) if zlib.crc32(str(i).encode()) % 2 else 0.3 for t, i in zip(texts, ids)]",
    "signal for about half the prompts",
)


def _args(tmp_path: Path, name: str, *flags: str) -> list[str]:
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "ds_probe.py").write_text(PROBE)
    args = ["recipes/train.py", "--config", "recipes/shapes/tiny_cpu.yaml", "--output_dir", str(tmp_path / "runs")]
    args += ["--run_name", name, "--reward_dirs", str(plugins), "--reward_funcs", "ds_probe", "--reward_weights", "1"]
    args += ["--report_to", "none", "--max_completion_length", "12", "--lora_dropout", "0", "--save_steps", "1"]
    return [*args, "--token_check_samples", "1", *flags]


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def _logged(text: str, key: str) -> list[float]:
    return [float(x) for x in re.findall(rf"'{re.escape(key)}': '([\d.]+)'", text)]


def test_rows_of_several_rounds_join_into_one_batch_padded_to_the_widest() -> None:
    def batch(prompt_width: int, completion_width: int, rows: int, first: int) -> dict:
        ids = torch.arange(first, first + rows * prompt_width).view(rows, prompt_width)
        return {
            "prompt_ids": ids,
            "prompt_mask": torch.ones_like(ids),
            "completion_ids": torch.full((rows, completion_width), 7),
            "completion_mask": torch.ones(rows, completion_width, dtype=torch.long),
            "old_per_token_logps": torch.full((rows, completion_width), -1.0),
            "mm_token_type_ids": torch.ones(rows, prompt_width + completion_width, dtype=torch.long),
            "advantages": torch.arange(rows, dtype=torch.float) + first,
            "num_items_in_batch": torch.tensor(rows * completion_width),
            "pixel_values": torch.arange(rows * 4, dtype=torch.float).view(rows * 4, 1) + first,
            "image_grid_thw": torch.tensor([[1, 2, 2]] * rows),
            "num_images": [1] * rows,
        }

    a, b = batch(3, 2, 2, 0), batch(2, 4, 3, 100)
    joined = join_rows([(a, [1]), (b, [2, 0])], pad_token_id=9)
    assert joined["prompt_ids"].tolist() == [[3, 4, 5], [9, 104, 105], [9, 100, 101]]  # left-padded
    assert joined["prompt_mask"].tolist() == [[1, 1, 1], [0, 1, 1], [0, 1, 1]]
    assert joined["completion_ids"].tolist() == [[7, 7, 9, 9], [7, 7, 7, 7], [7, 7, 7, 7]]  # right-padded
    assert joined["completion_mask"].tolist() == [[1, 1, 0, 0], [1] * 4, [1] * 4]
    assert joined["old_per_token_logps"][0].tolist() == [-1.0, -1.0, 0.0, 0.0]
    assert joined["mm_token_type_ids"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]]
    assert joined["advantages"].tolist() == [1.0, 102.0, 100.0]
    assert joined["pixel_values"].view(-1).tolist() == [4, 5, 6, 7, 108, 109, 110, 111, 100, 101, 102, 103]
    assert joined["num_images"] == [1, 1, 1] and joined["image_grid_thw"].shape == (3, 3)
    assert live_groups(torch.tensor([0.0, 0.0, 0.5, -0.5, 0.0, 0.0]), 2) == [False, True, False]


def test_groups_without_signal_are_replaced_until_the_rounds_run_out(tmp_path: Path) -> None:
    log = tmp_path / "probe.jsonl"
    env = {"PROBE_LOG": str(log)}
    process = run_script(_args(tmp_path, "three", "--max_steps", "3", "--dynamic_sampling_rounds", "3"), env=env)
    text = process.stdout + process.stderr
    rounds, generated = _logged(text, "dynamic_sampling/rounds"), _logged(text, "dynamic_sampling/groups_generated")
    kept, degenerate = _logged(text, "dynamic_sampling/groups_kept"), _logged(text, "degenerate_fraction")
    assert len(rounds) == len(generated) == len(kept) == len(degenerate) == 3
    assert max(rounds) > 1  # some step needed another round
    # 2 prompts, then as many as are missing
    assert all(2 + r - 1 <= g <= 2 * r for g, r in zip(generated, rounds, strict=True))
    for r, k, d in zip(rounds, kept, degenerate, strict=True):
        assert (k == 2) == (d == 0)  # a full batch of groups with signal trains with none degenerate
        assert r == 4 or k == 2  # rounds stop as soon as the batch is full
    calls = _records(log)
    assert len(calls) == sum(rounds)  # every round scored once
    manifest = json.loads((tmp_path / "runs" / "three" / "manifest.json").read_text())
    assert manifest["extra_prompts"] == sum(generated) - 2 * 3

    off = run_script(_args(tmp_path, "off", "--max_steps", "3"), env={"PROBE_LOG": str(tmp_path / "off.jsonl")})
    assert "dynamic_sampling/rounds" not in off.stdout + off.stderr
    assert json.loads((tmp_path / "runs" / "off" / "manifest.json").read_text())["extra_prompts"] == 0


@pytest.mark.slow
def test_a_generation_batch_that_splits_a_group_between_ranks_is_refused_naming_the_keys(tmp_path: Path) -> None:
    """12 completions on 2 processes is 3 groups of 4 for TRL; each rank's 6 would split one, which the rounds'
    replacement (whole groups per rank) cannot use."""
    launch = ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml"]
    launch += ["--num_processes", "2", "--main_process_port", "0"]
    args = _args(tmp_path, "split", "--dynamic_sampling_rounds", "1", "--per_device_train_batch_size", "6")
    process = run_script([*launch, *args], env={"PROBE_LOG": str(tmp_path / "p.jsonl")}, check=False, timeout=600)
    assert process.returncode != 0
    expected = "each process's generation batch (6 completions) must hold whole groups of num_generations (4)"
    assert expected in process.stderr


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_with_the_same_prompts_and_weights(tmp_path: Path) -> None:
    """The extra rounds' prompts are a function of (seed, step, round): the resumed run draws what the uninterrupted
    one drew, and ends with its weights bit for bit."""
    flags = ["--max_steps", "5", "--dynamic_sampling_rounds", "2"]
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    run_script(_args(tmp_path, "whole", *flags), env={"PROBE_LOG": str(whole)})
    steps = [r["step"] for r in _records(whole)]
    rounds_at = [step for step in range(1, 5) if steps.count(step) > 1]
    assert rounds_at, "the premise: some step after the first needed an extra round"
    kill = rounds_at[-1]  # killed in the step after checkpoint-<kill>: the resume redoes a step with extra rounds
    killed = run_script(
        _args(tmp_path, "cut", *flags), env={"PROBE_LOG": str(cut), "PROBE_KILL_AT_STEP": str(kill)}, check=False
    )
    assert killed.returncode == -signal.SIGKILL
    run_script(_args(tmp_path, "cut", *flags, "--resume_from_checkpoint", "last"), env={"PROBE_LOG": str(cut)})
    first = _records(cut)[0]["pid"]
    after = [(r["step"], r["ids"]) for r in _records(cut) if r["pid"] != first]
    assert after == [(r["step"], r["ids"]) for r in _records(whole) if r["step"] >= kill]
    expected = load_file(tmp_path / "runs" / "whole" / "adapter_model.safetensors")
    got = load_file(tmp_path / "runs" / "cut" / "adapter_model.safetensors")
    assert all(torch.equal(expected[key], got[key]) for key in expected)


@pytest.mark.slow
def test_every_rank_runs_the_same_rounds_and_draws_its_own_prompts(tmp_path: Path) -> None:
    log = tmp_path / "probe.jsonl"
    launch = ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml"]
    launch += ["--num_processes", "2", "--main_process_port", "0"]
    flags = ["--max_steps", "3", "--dynamic_sampling_rounds", "3"]
    run_script([*launch, *_args(tmp_path, "ranks", *flags)], env={"PROBE_LOG": str(log)}, timeout=900)
    calls = _records(log)
    for step in {r["step"] for r in calls}:
        per_rank = {rank: [r["ids"] for r in calls if r["step"] == step and r["rank"] == rank] for rank in (0, 1)}
        assert len(per_rank[0]) == len(per_rank[1]) >= 1  # the same rounds on both ranks
        for ids_0, ids_1 in zip(per_rank[0], per_rank[1], strict=True):
            assert not set(ids_0) & set(ids_1)  # each rank its own prompts
    assert os.path.isfile(tmp_path / "runs" / "ranks" / "adapter_model.safetensors")
