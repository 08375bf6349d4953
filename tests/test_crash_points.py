"""Crash-point testing (issue 37, item 1): each path is run once uninterrupted with `VISION_GRPO_CRASH_LOG` to
count its durable writes (`vision_grpo/storage/crash_points.py`), then killed (SIGKILL, from inside, at that point)
at every one of them in turn - or at a seeded sample where a path has many, the seed printed - and rerun as
docs/reliability.md says. The rerun must end with the uninterrupted run's outputs: the same rows, the same
evaluation records once each, the same exported bytes, bit-identical weights.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import FAMILY_MODELS, run_script
from lora_runs import lora_run
from safetensors.torch import load_file
from test_data_cache import recipe, write_source
from test_evaluate import SHAPES_RECIPE
from test_resume import folder_bytes, training_args

from vision_grpo.evaluation.evaluate import TIMING_KEYS
from vision_grpo.evaluation.results import partial_path
from vision_grpo.storage import writes
from vision_grpo.storage.writes import write_text_atomic

CRASH_AT, CRASH_LOG = "VISION_GRPO_CRASH_AT", "VISION_GRPO_CRASH_LOG"


def crash_points(argv: list[str], log: Path, env: dict[str, str] | None = None) -> list[str]:
    """The names of the durable writes an uninterrupted run of `argv` passes, in order."""
    run_script(argv, env={**(env or {}), CRASH_LOG: str(log)}, timeout=600)
    return [line.split(" ", 2)[2] for line in log.read_text(encoding="utf-8").splitlines()]


def crashed_at(argv: list[str], k: int, env: dict[str, str] | None = None) -> None:
    """Run `argv`, killed at its k-th durable write."""
    killed = run_script(argv, env={**(env or {}), CRASH_AT: str(k)}, timeout=600, check=False)
    assert killed.returncode == -signal.SIGKILL, f"not killed at point {k}:\n{killed.stderr[-3000:]}"


def sampled(count: int, size: int, seed: int) -> list[int]:
    """Every point 1..count, or `size` of them drawn with `seed` (printed, so a failure can be replayed)."""
    if count <= size:
        return list(range(1, count + 1))
    print(f"crash points: {size} of {count} sampled with seed {seed}")
    return sorted(random.Random(seed).sample(range(1, count + 1), size))


# ---------------------------------------------------------------------------------------------------------------------
# What a kill between an atomic write and its rename leaves: the temporary file.

WRITE_ONE = (
    "import sys; from pathlib import Path; from vision_grpo.storage.writes import write_text_atomic; "
    "write_text_atomic(Path(sys.argv[1]), 'killed')"
)


def test_the_temporary_a_killed_writer_left_is_removed_by_the_next_write_of_that_file(tmp_path: Path) -> None:
    """Killed at its first point (written, not yet renamed), a writer leaves its temporary beside the file; the
    next write of that file removes it, but never a live writer's, nor a fresh one of another machine."""
    path = tmp_path / "manifest.json"
    crashed_at(["-c", WRITE_ONE, str(path)], 1)
    (left,) = tmp_path.iterdir()
    assert writes.is_temporary_of(left, path) and left.read_text() == "killed" and not path.exists()
    with subprocess.Popen(["sleep", "30"]) as alive:
        live = path.with_name(f"{path.name}.{writes.HOST}.{alive.pid}-0123abcd.tmp")
        other_host = path.with_name(f"{path.name}.elsewhere.{os.getpid()}-4567cdef.tmp")
        other_host_old = path.with_name(f"{path.name}.elsewhere.{os.getpid()}-89abcdef.tmp")
        not_ours = path.with_name(f"{path.name}.notes.tmp")
        for file in (live, other_host, other_host_old, not_ours):
            file.write_text("")
        hours_ago = time.time() - 2 * writes.STALE_TEMPORARY_S
        os.utime(other_host_old, (hours_ago, hours_ago))
        write_text_atomic(path, "next")
        alive.kill()
    assert path.read_text() == "next"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (path, live, other_host, not_ours))


def test_an_atomic_write_reaches_the_disk_before_its_rename_and_the_rename_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a power cut needs (a kill does not): the new content flushed before the rename makes it the file, and
    the folder's entry flushed after, in that order."""
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, Path.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), fsync(fd))
    )
    monkeypatch.setattr(Path, "replace", lambda self, to: (events.append(("replace", str(self))), replace(self, to))[1])
    path = tmp_path / "result.json"
    write_text_atomic(path, "whole")
    (_, temporary), _, _ = events
    assert events == [("fsync", temporary), ("replace", temporary), ("fsync", str(tmp_path))]
    assert temporary != str(path) and path.read_text() == "whole"


# ---------------------------------------------------------------------------------------------------------------------
# The checking pass: the rows cache, its seal and the source-digest memo.

LOAD_ROWS = """
import json, sys
import datasets
from trl import GRPOConfig, ModelConfig
from vision_grpo.data import get_dataset
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
datasets.config.HF_DATASETS_CACHE = sys.argv[1]
args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), sys.argv[3:])[0]
rows = get_dataset(args, "train", 168 * 168)
with open(sys.argv[2], "w") as out:
    json.dump([list(rows["id"]), list(rows["answer"])], out)
"""


@pytest.mark.slow
def test_the_checking_pass_killed_at_every_write_gives_the_same_rows_on_rerun(tmp_path: Path) -> None:
    folder = write_source(tmp_path / "data", [str(i % 9) for i in range(40)])
    script = tmp_path / "load.py"
    script.write_text(LOAD_ROWS)

    def argv(cache: Path, out: Path) -> list[str]:
        return [str(script), str(cache), str(out), *recipe(folder)]

    whole = tmp_path / "whole.json"
    names = crash_points(argv(tmp_path / "cache-whole", whole), tmp_path / "points.log")
    assert any("not yet sealed" in name for name in names) and any(".seal.json" in name for name in names), names
    for k in range(1, len(names) + 1):
        cache, out = tmp_path / f"cache-{k}", tmp_path / f"rows-{k}.json"
        crashed_at(argv(cache, out), k)
        run_script(argv(cache, out))  # the same command again
        assert json.loads(out.read_text()) == json.loads(whole.read_text()), f"other rows after a crash at {k}"
        again = run_script(argv(cache, tmp_path / "again.json"), env={CRASH_LOG: str(tmp_path / f"after-{k}.log")})
        assert again.returncode == 0 and not (tmp_path / f"after-{k}.log").exists(), "the rerun left no sealed cache"
    print(f"checking pass: {len(names)} crash points, all tried: {names}")


# ---------------------------------------------------------------------------------------------------------------------
# The evaluator: the partial records file, each round's append, the result JSON.


@pytest.mark.slow
def test_an_evaluation_killed_at_every_write_resumes_to_the_same_records_once_each(tmp_path: Path) -> None:
    def argv(output: Path, *extra: str) -> list[str]:
        return [
            "eval/evaluate.py", "--config", SHAPES_RECIPE, "--limit", "5", "--batch_size", "1",
            "--max_new_tokens", "8", "--output", str(output), *extra,
        ]  # fmt: skip

    def result(output: Path) -> dict:
        """The result without its timings, and with its own path in the recorded argv named `<output>`."""
        content = json.loads(output.read_text(encoding="utf-8"))
        for key in TIMING_KEYS:
            content["summary"].pop(key)
        recorded = content["metadata"]["argv"]
        content["metadata"]["argv"] = ["<output>" if arg == str(output) else arg for arg in recorded]
        return content

    # Counted on a second run: the first builds the embedded replica and the rows cache, which later runs only read.
    run_script(argv(tmp_path / "first.json"))
    whole = tmp_path / "whole.json"
    names = crash_points(argv(whole), tmp_path / "points.log")
    expected = result(whole)
    assert len(expected["records"]) == 5
    for k in range(1, len(names) + 1):
        output = tmp_path / f"eval-{k}.json"
        crashed_at(argv(output), k)
        partial = partial_path(output)
        if partial.exists():
            lines = partial.read_text(encoding="utf-8").splitlines()[1:]
            ids = [json.loads(line)["id"] for line in lines]
            assert len(ids) == len(set(ids)), f"a record written twice before the crash at {k}: {ids}"
        rerun = run_script(argv(output, "--resume"), check=False)
        assert rerun.returncode == 0, f"the rerun after a crash at {k} ({names[k - 1]}) failed:\n{rerun.stderr[-3000:]}"
        got = result(output)
        assert [r["id"] for r in got["records"]] == [r["id"] for r in expected["records"]], f"crash at {k}"
        assert got == expected, f"other records after a crash at {k} ({names[k - 1]})"
        assert not partial.exists()
    print(f"evaluation: {len(names)} crash points, all tried: {names}")


# ---------------------------------------------------------------------------------------------------------------------
# Training: the manifest and recipe copy, each checkpoint (the Trainer's files, then our checksums), the final save.

STEPS = {"max_steps": "3", "save_steps": "1"}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter_model.safetensors"))


def resume_as_the_docs_say(argv: list[str], env: dict[str, str], timeout: float = 600) -> None:
    """`--resume_from_checkpoint last`; where the run stopped before its first checkpoint, the message says to run
    the interrupted command again, and that is run. Past `timeout` seconds the process is SIGKILLed
    (`subprocess.TimeoutExpired`)."""
    resumed = run_script([*argv, "--resume_from_checkpoint", "last"], env=env, check=False, timeout=timeout)
    if resumed.returncode != 0 and "no complete checkpoint in" in resumed.stderr:
        resumed = run_script(argv, env=env, check=False, timeout=timeout)
    assert resumed.returncode == 0, resumed.stderr[-3000:]


def seed_of_this_run() -> int:
    """`CRASH_POINTS_SEED` to replay a failure, else a new seed each run (printed), so runs cover more points."""
    return int(os.environ.get("CRASH_POINTS_SEED") or random.SystemRandom().randrange(10**6))


@pytest.mark.slow
def test_training_killed_at_sampled_writes_resumes_to_bit_identical_weights(tmp_path: Path) -> None:
    # Counted on a second run: the first writes the rows cache and the model's digest memo, which later runs read.
    run_script(training_args(tmp_path, "first", **STEPS), env={"PROBE_LOG": str(tmp_path / "first.jsonl")})
    whole = training_args(tmp_path, "whole", **STEPS)
    names = crash_points(whole, tmp_path / "points.log", env={"PROBE_LOG": str(tmp_path / "probe.jsonl")})
    expected = final_weights(tmp_path / "runs" / "whole")
    assert any("no checksums yet" in name for name in names) and any("checksums.json" in name for name in names)
    seed = seed_of_this_run()
    chosen = sampled(len(names), int(os.environ.get("CRASH_POINTS_SAMPLE", "4")), seed)
    for k in chosen:
        argv = training_args(tmp_path, f"cut-{k}", **STEPS)
        probe = {"PROBE_LOG": str(tmp_path / f"probe-{k}.jsonl")}
        crashed_at(argv, k, env=probe)
        resume_as_the_docs_say(argv, probe)
        got = final_weights(tmp_path / "runs" / f"cut-{k}")
        assert expected.keys() == got.keys()
        same = all(torch.equal(expected[key], got[key]) for key in expected)
        assert same, f"other weights after a crash at {k} ({names[k - 1]}), seed {seed}"
    print(f"training: {len(names)} crash points, tried {chosen} (seed {seed}): {names}")


@pytest.mark.slow
def test_a_run_killed_after_its_last_checkpoint_resumes_to_its_end_without_another_step(tmp_path: Path) -> None:
    """3 steps, 2 a epoch: killed once checkpoint-3 is whole, before the end record. transformers' loop would run a
    fourth step on the resume (it checks max_steps only after a step); the resume must only save and close."""
    probe = {"PROBE_LOG": str(tmp_path / "first.jsonl")}
    run_script(training_args(tmp_path, "first", **STEPS), env=probe)  # caches built: the next run's points are its own
    argv = training_args(tmp_path, "cut", **STEPS)
    names = crash_points(training_args(tmp_path, "whole", **STEPS), tmp_path / "points.log", env=probe)
    last_checkpoint = max(k for k, name in enumerate(names, 1) if name == "checksums.json renamed into place")
    assert names[last_checkpoint:] and all("manifest.json" in name for name in names[last_checkpoint:]), names
    crashed_at(argv, last_checkpoint, env=probe)
    resumed_log = tmp_path / "resumed.jsonl"
    run_script([*argv, "--resume_from_checkpoint", "last"], env={"PROBE_LOG": str(resumed_log)})
    run_dir = tmp_path / "runs" / "cut"
    assert not resumed_log.exists(), f"the resume trained again: {resumed_log.read_text()}"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["ended"] is not None and manifest["global_step"] == 3
    expected, got = final_weights(tmp_path / "runs" / "whole"), final_weights(run_dir)
    assert expected.keys() == got.keys() and all(torch.equal(expected[key], got[key]) for key in expected)


KILLS = 3


@pytest.mark.slow
def test_training_killed_at_random_moments_resumes_to_bit_identical_weights(tmp_path: Path) -> None:
    """SIGKILLs at random moments, not at writes: each of KILLS starts (the first fresh, then resumes) is killed
    after a delay drawn (seed printed) from the uninterrupted run's own duration, wherever it is then; a last resume
    runs to the end. A start that ended before its delay is simply done (a later resume finds it finished)."""
    probe = {"PROBE_LOG": str(tmp_path / "probe.jsonl")}
    run_script(training_args(tmp_path, "first", **STEPS), env=probe)  # timed on a second run: caches built
    began = time.monotonic()
    run_script(training_args(tmp_path, "whole", **STEPS), env=probe)
    took = time.monotonic() - began
    expected = final_weights(tmp_path / "runs" / "whole")
    seed = seed_of_this_run()
    draw = random.Random(seed)
    delays = [round(draw.uniform(0.1, 1.0) * took, 2) for _ in range(KILLS)]
    print(f"random kills: after {delays} s of a {took:.1f} s run (seed {seed})")
    argv = training_args(tmp_path, "cut", **STEPS)
    killed = 0
    for i, delay in enumerate(delays):
        try:
            if i == 0:
                run_script(argv, env=probe, timeout=delay)
            else:
                resume_as_the_docs_say(argv, probe, timeout=delay)
        except subprocess.TimeoutExpired:
            killed += 1
    resume_as_the_docs_say(argv, probe)
    got = final_weights(tmp_path / "runs" / "cut")
    same = expected.keys() == got.keys() and all(torch.equal(expected[key], got[key]) for key in expected)
    assert same, f"other weights after kills at {delays} s (seed {seed})"
    print(f"random kills: {killed} of {KILLS} starts killed, bit-identical weights")


# ---------------------------------------------------------------------------------------------------------------------
# The export: the merged weights in the staging folder, the staging folder complete, renamed to --output.


@pytest.mark.slow
def test_an_export_killed_at_every_write_gives_the_same_folder_on_rerun(tmp_path: Path) -> None:
    run_dir = lora_run(tmp_path / "run", FAMILY_MODELS[0], SHAPES_RECIPE)
    output = tmp_path / "exports" / "exported"  # one path for every run: the model card records the command
    output.parent.mkdir()
    argv = ["-m", "vision_grpo.export", "--adapter", str(run_dir), "--output", str(output), "--max_shard_size", "1MB"]
    # Counted on a second export: the first remembers the base model's digest (digests.json), later ones read it.
    run_script([*argv[:-3], str(tmp_path / "first"), *argv[-2:]])
    names = crash_points(argv, tmp_path / "points.log")
    expected = folder_bytes(output)
    assert len(names) == 3, names
    for k in range(1, len(names) + 1):
        shutil.rmtree(output)
        crashed_at(argv, k)
        rerun = run_script(argv, check=False)  # the same command again
        if k < len(names):
            assert rerun.returncode == 0, f"the rerun after a crash at {k} ({names[k - 1]}) failed:\n{rerun.stderr}"
        else:  # killed after the rename: the export is whole, and the rerun refuses to write over it
            assert rerun.returncode != 0 and f"output {output} already holds something" in rerun.stderr
        assert folder_bytes(output) == expected, f"another folder after a crash at {k} ({names[k - 1]})"
        left = sorted(path.name for path in output.parent.iterdir())
        # A lock file left by the kill after the rename is stale, taken over by the next export to this output.
        kept = [output.name, f"{output.name}.lock"] if k == len(names) else [output.name]
        assert left == kept, f"left beside --output after a crash at {k} and the rerun: {left}"
    print(f"export: {len(names)} crash points, all tried: {names}")
