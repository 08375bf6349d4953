"""A stop signal sent to `accelerate launch`, as a scheduler sends it, stops every worker of the run.

accelerate's plain launcher (`accelerate launch --num_processes 2 --cpu recipes/train.py …`) forwards no signal and
dies of a SIGTERM at once; its worker must stop too (vision_grpo/run/launched.py), not run on as an orphan writing into
the run folder. Started in a session of their own, so that a failing test still kills every process it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO

from vision_grpo.run.resume import TRAINER_STATE, resume_checkpoint

PLAIN_LAUNCHER = ["--num_processes", "2", "--cpu"]  # the form: accelerate's plain launcher, one worker
STEP_PROBE = '''
import json
import os

from vision_grpo.rewards import reward


@reward()
def step_probe(completions, trainer_state, **kwargs):
    """Test only: log which step this process is scoring."""
    with open(os.environ["STEP_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps({"step": trainer_state.global_step, "pid": os.getpid()}) + "\\n")
    return [0.0] * len(completions)
'''


def launch(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    """`accelerate launch --num_processes 2 --cpu recipes/train.py` on the tiny recipe, a few tiny steps."""
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "step_probe.py").write_text(STEP_PROBE)
    args = [
        *("--config", "recipes/shapes/tiny_cpu.yaml", "--output_dir", str(tmp_path / "runs"), "--run_name", "a"),
        *("--shapes_train_size", "8", "--max_completion_length", "8", "--token_check_samples", "1"),
        *("--reward_funcs", "step_probe", "--reward_weights", "1.0", "--reward_dirs", str(plugins)),
        *("--report_to", "none", "--save_strategy", "no", *overrides),
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", *PLAIN_LAUNCHER, "recipes/train.py", *args],
        cwd=REPO,
        env={**os.environ, "STEP_LOG": str(tmp_path / "steps.jsonl")},
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "stderr.txt").open("w"),  # not a pipe, which a chatty orphan could fill and block on
        start_new_session=True,
    )


def wait_for(condition, launcher: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if launcher.poll() is not None:
            raise AssertionError(f"the run ended before {what} ({launcher.returncode}); see its stderr.txt")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.1)


def stop_all(launcher: subprocess.Popen) -> None:
    """Kill whatever the test started and is still running (the session's processes)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGKILL)


def gone_within(processes: list[psutil.Process], seconds: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=seconds)
    return not alive


def importing_torch(worker: psutil.Process) -> bool:
    """Whether the worker runs the entry point and has begun loading torch (the imports that take seconds, after
    vision_grpo.run.launched). Between fork and exec the child still maps its launcher's torch: a signal then comes
    before the worker could ask for one (the one start-up window vision_grpo/run/launched.py says goes unnoticed)."""
    try:
        started = worker.cmdline()[1:2] == ["recipes/train.py"]
        return started and any("libtorch" in Path(m.path).name for m in worker.memory_maps(grouped=True))
    except psutil.Error:
        return False


@pytest.mark.slow
def test_a_launcher_killed_while_its_worker_imports_stops_the_worker(tmp_path: Path) -> None:
    """SIGTERM to the launcher during the worker's imports (seconds of torch and TRL; before: the worker had not yet
    asked for its launcher's death signal, and trained all its steps as an orphan)."""
    launcher = launch(tmp_path, "--max_steps", "200")
    try:
        wait_for(lambda: psutil.Process(launcher.pid).children(), launcher, "the worker started")
        (worker,) = psutil.Process(launcher.pid).children()
        wait_for(lambda: importing_torch(worker), launcher, "the worker began importing torch")
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)
        assert gone_within([worker], 30), "the worker runs on after its launcher died"
        assert not (tmp_path / "steps.jsonl").exists(), "the orphan trained"
    finally:
        stop_all(launcher)


@pytest.mark.slow
def test_a_launcher_killed_during_training_leaves_a_checkpoint_to_resume(tmp_path: Path) -> None:
    """SIGTERM to the launcher once training runs: the worker finishes its step, saves a checkpoint and ends, and
    `--resume_from_checkpoint last` continues from it."""
    launcher = launch(tmp_path, "--max_steps", "200")
    log = tmp_path / "steps.jsonl"
    try:
        wait_for(lambda: log.exists() and log.read_text().count("\n") >= 1, launcher, "the first step")
        (worker,) = psutil.Process(launcher.pid).children()
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)
        assert gone_within([worker], 120), "the worker runs on after its launcher died"
    finally:
        stop_all(launcher)
    run_dir = tmp_path / "runs" / "a"
    checkpoint = Path(resume_checkpoint("last", run_dir))
    stopped_at = json.loads((checkpoint / TRAINER_STATE).read_text())["global_step"]
    assert checkpoint.name == f"checkpoint-{stopped_at}" and 1 <= stopped_at < 200
    scored = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert max(scored) == stopped_at - 1, "steps went on after the checkpoint"
    assert json.loads((run_dir / "manifest.json").read_text())["ended"] is not None


@pytest.mark.slow
def test_a_signal_to_a_sweep_stops_its_run_with_a_checkpoint_and_starts_no_other(tmp_path: Path) -> None:
    """SIGTERM to `recipes/sweep.py` (before: the sweep died and its training ran on, an orphan, every step; a Ctrl-C
    made subprocess.run SIGKILL the training before it could save)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "step_probe.py").write_text(STEP_PROBE)
    log = tmp_path / "steps.jsonl"
    args = [
        *("recipes/sweep.py", "--sweep_name", "s", "--config", "recipes/shapes/tiny_cpu.yaml"),
        *("--output_dir", str(tmp_path / "runs"), "--learning_rate", "1e-3,2e-3", "--max_steps", "200"),
        *("--shapes_train_size", "8", "--max_completion_length", "8", "--token_check_samples", "1"),
        *("--reward_funcs", "step_probe", "--reward_weights", "1.0", "--reward_dirs", str(plugins)),
        *("--report_to", "none", "--save_strategy", "no"),
    ]
    sweep = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env={**os.environ, "STEP_LOG": str(log)},
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "stderr.txt").open("w"),
        start_new_session=True,
    )
    try:
        wait_for(lambda: log.exists() and log.read_text().count("\n") >= 1, sweep, "the first step")
        (training,) = psutil.Process(sweep.pid).children()
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=120) == 1
        assert gone_within([training], 30), "the training runs on after its sweep ended"
    finally:
        stop_all(sweep)
        with contextlib.suppress(ProcessLookupError, NameError):
            os.killpg(training.pid, signal.SIGKILL)  # its own process group
    stderr = (tmp_path / "stderr.txt").read_text()
    assert "SweepError: stopped by signal 15 during run s_learning_rate=1e-3" in stderr
    assert "--resume_from_checkpoint last`; not started: ['s_learning_rate=2e-3']" in stderr
    assert resume_checkpoint("last", tmp_path / "runs" / "s_learning_rate=1e-3")
    assert not (tmp_path / "runs" / "s_learning_rate=2e-3").exists()


FINISHING = """
import atexit, sys, threading, time
import vision_grpo.run.launched as launched
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.5), print("thread joined", end=""))).start()
print("unflushed", end="")
launched.finish()
print(" after finish")
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_worker_finishes_with_its_threads_joined_its_exit_handlers_run_and_its_output_flushed(
    world_size: str,
) -> None:
    """`launched.finish` leaves a worker of a multi-process launch before the interpreter's finalisation (where gloo's
    threads can abort it), having done what finalisation would; a single process goes on and finalises as usual."""
    env = {**os.environ, "LOCAL_RANK": "0", "WORLD_SIZE": world_size}
    done = subprocess.run([sys.executable, "-c", FINISHING], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if world_size == "2":
        assert done.stdout == "unflushedthread joinedatexit ran\n"
    else:
        assert done.stdout == "unflushed after finish\nthread joinedatexit ran\n"
