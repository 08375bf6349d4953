"""A rank that stops answering: the others end the launch within `rank_stall_timeout`, naming it, and the run
resumes (vision_grpo/run/rank_watch.py). Before, they waited in their next collective for the process group's
timeout (30 minutes).

The judgement is tested on its own with a clock of the test's choosing; the heartbeat through a real store, with
a peer that stops and a store whose process is stopped; and a real 2-process run whose rank 0 gets SIGSTOP.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from conftest import REPO, run_script
from test_resume import probe_records, training_args, wait_for_step

from vision_grpo.evaluation.results import partial_path
from vision_grpo.run.rank_watch import RankWatch

HOST = socket.gethostname()


class Stalls:
    """An `on_stall` that records the message instead of ending the process."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.event = threading.Event()

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        self.event.set()


def test_a_peer_is_overdue_after_the_timeout_of_silence_and_time_this_process_missed_does_not_count() -> None:
    watch = RankWatch(None, rank=0, world_size=3, timeout=10, store_at="h:1", on_stall=Stalls())  # interval 1 s
    start = time.monotonic()
    watch.seen({1: 1, 2: 1}, {1: "pid 7 on a", 2: "pid 8 on b"}, start)
    for second in range(1, 11):
        watch.seen({1: 1, 2: 1 + second}, {}, start + second)  # rank 2 beats, rank 1 does not
        assert watch.overdue(start + second) is None
    message = watch.overdue(start + 10.5)
    assert message.startswith("rank 1 (pid 7 on a) has not answered for 10 s (rank_stall_timeout: 10 s): stopped")
    assert "ending rank 0 so that the launch ends" in message and "--resume_from_checkpoint last" in message

    watch = RankWatch(None, rank=1, world_size=2, timeout=10, store_at="h:1", on_stall=Stalls())
    watch.seen({0: 1}, {0: "pid 7 on a"}, start)
    watch.seen({0: 1}, {}, start + 1)  # the store answers, rank 0's counter does not move
    assert watch.overdue(start + 1) is None
    watch.seen({0: 1}, {}, start + 60)
    assert watch.overdue(start + 60) is None, "a minute this process did not run was counted against rank 0"
    for second in range(61, 71):
        watch.seen({0: 1}, {}, start + second)
        assert watch.overdue(start + second) is None
    assert watch.overdue(start + 70.5).startswith("rank 0 (pid 7 on a) has not answered for 10 s")


def test_a_thread_s_heartbeat_goes_on_through_a_long_call_and_stops_with_its_rank() -> None:
    """Two ranks in this process share a real TCPStore; the main thread hashes for three timeouts (a long C call,
    as the main process hashing a large model while the others wait): no alarm. Rank 1 stops: rank 0 names it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stalls = {rank: Stalls() for rank in (0, 1)}
    watches = {
        rank: RankWatch(dist.PrefixStore("w", server), rank, 2, timeout=1.0, store_at="here", on_stall=stalls[rank])
        for rank in (0, 1)
    }
    for watch in watches.values():
        watch.start()
    try:
        block, until = bytes(32 << 20), time.monotonic() + 3.0
        while time.monotonic() < until:
            hashlib.sha256(block).digest()
        assert stalls[0].messages == stalls[1].messages == []
        watches[1].stop()
        stopped = time.monotonic()
        assert stalls[0].event.wait(5), "rank 0 never named the rank that stopped"
        assert 0.5 <= time.monotonic() - stopped < 3
        assert stalls[0].messages[0].startswith(f"rank 1 (pid {os.getpid()} on {HOST}) has not answered for 1 s")
    finally:
        for watch in watches.values():
            watch.stop()


def _serve_store(port) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port.value = store.port
    time.sleep(600)


def test_a_store_whose_process_stopped_is_named() -> None:
    """A store's host that is stopped never answers, and a TCPStore read has no timeout: the judge still speaks."""
    context = multiprocessing.get_context("fork")
    port = context.Value("i", 0)
    host = context.Process(target=_serve_store, args=(port,), daemon=True)
    host.start()
    try:
        deadline = time.monotonic() + 30
        while not port.value and time.monotonic() < deadline:
            time.sleep(0.05)
        client = dist.TCPStore("127.0.0.1", port.value, is_master=False, wait_for_workers=False)
        stalls = Stalls()
        watch = RankWatch(client, 0, 2, timeout=1.0, store_at=f"127.0.0.1:{port.value}", on_stall=stalls).start()
        os.kill(host.pid, signal.SIGSTOP)
        assert stalls.event.wait(10), "a stopped store went unnoticed"
        assert stalls.messages[0].startswith(f"the launch's store at 127.0.0.1:{port.value} has not answered for")
        watch.stop()
    finally:
        host.kill()  # SIGKILL ends a stopped process; the blocked beat thread then sees the connection closed
        host.join()


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie awaiting its parent has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


STALL_TIMEOUT = 5
AGENT_GRACE = 30  # torchrun's agent: SIGTERM to the workers left, SIGKILL 30 s later (torch's `_stop_workers`)


LAUNCH = ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml"]


def end_the_launch(process: subprocess.Popen) -> None:
    """Whatever a failed test left of the launch: its process group, workers included (stopped ones too)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)


def stop_rank_0_and_check_the_launch_ends(process: subprocess.Popen, pids: dict[int, int]) -> str:
    """SIGSTOP to rank 0 of the launch `process` (workers `pids`, by rank): rank 1 ends within the timeout naming
    rank 0, the launch then ends with an error, and no worker outlives it. Returns its stderr. The test kills the
    stopped rank once rank 1 has ended, as torchrun's agent does 30 s later (torch's grace for a failed worker group,
    hard-coded in `LocalElasticAgent._stop_workers`: torch's behaviour, not ours, and half of this test's time)."""
    try:
        os.kill(pids[0], signal.SIGSTOP)
        stopped = time.monotonic()
        while running(pids[1]) and time.monotonic() - stopped < STALL_TIMEOUT + 15:
            time.sleep(0.1)
        rank_1_ended = time.monotonic() - stopped
        if not running(pids[1]):
            os.kill(pids[0], signal.SIGKILL)
        _, stderr = process.communicate(timeout=AGENT_GRACE + 30)
        launch_ended = time.monotonic() - stopped
    finally:
        for pid in pids.values():
            if running(pid):
                os.kill(pid, signal.SIGKILL)  # ends a stopped process too
    print(f"rank 1 ended {rank_1_ended:.1f} s after the stop, the launch {launch_ended:.1f} s")  # pytest -s shows it
    assert STALL_TIMEOUT - 1 <= rank_1_ended < STALL_TIMEOUT + 10, f"rank 1 ended {rank_1_ended:.1f} s after the stop"
    assert process.returncode != 0
    assert f"error: RankStalled: rank 0 (pid {pids[0]} on {HOST}) has not answered for" in stderr, stderr[-4000:]
    assert launch_ended < STALL_TIMEOUT + 25
    assert not [pid for pid in pids.values() if running(pid)], "a worker outlived its launcher"
    return stderr


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`accelerate launch` of 2 CPU processes in a session of its own, stderr kept."""
    return subprocess.Popen(
        [sys.executable, *LAUNCH, *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_a_stopped_rank_ends_the_launch_naming_it_and_the_run_resumes(tiny_model_path: Path, tmp_path: Path) -> None:
    """SIGSTOP to rank 0 (the main process: it holds the run folder's lock) after the first checkpoint: rank 1 ends
    within the timeout naming it, the launch ends, nothing is left running, and the same command
    with `--resume_from_checkpoint last` trains to the end."""
    log = tmp_path / "probe.jsonl"
    steps = {"max_steps": "3", "save_steps": "1", "rank_stall_timeout": str(STALL_TIMEOUT)}
    process = launch(*training_args(tmp_path, "stalled", **steps), env={"PROBE_LOG": str(log)})
    try:
        wait_for_step(log, process, step=1, timeout=120)  # step 1 is generating: checkpoint-1 is complete
        pids = {record["rank"]: record["pid"] for record in probe_records(log)}
        stderr = stop_rank_0_and_check_the_launch_ends(process, pids)
    finally:
        end_the_launch(process)
    assert "continue with --resume_from_checkpoint last" in stderr

    run_dir = tmp_path / "runs" / "stalled"
    assert (run_dir / "checkpoint-1" / "trainer_state.json").is_file()
    resume = training_args(tmp_path, "stalled", **steps, resume_from_checkpoint="last")
    run_script([*LAUNCH, *resume], env={"PROBE_LOG": str(log)}, timeout=300)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["global_step"] == 3 and manifest["ended"] is not None
    assert (run_dir / "adapter_model.safetensors").is_file()


def workers(launcher: int) -> dict[int, int]:
    """{rank: pid} of the worker processes under `launcher`: its descendants started with RANK in their environment
    (the agent sets it for each worker; the launcher's own environment has none). psutil finds descendants by every
    process's parent id: reading /proc/<pid>/task/*/children fails for a thread of the launcher that ends meanwhile."""
    found = {}
    for process in psutil.Process(launcher).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            rank = process.environ().get("RANK")
            if rank is not None and process.parent().environ().get("RANK") is None:  # a worker, not its child
                found[int(rank)] = process.pid
    return found


EVALUATION = ["eval/evaluate.py", "--config", "recipes/shapes/tiny_cpu.yaml", "--limit", "24", "--batch_size", "2"]
EVALUATION += ["--max_new_tokens", "24", "--rank_stall_timeout", str(STALL_TIMEOUT)]


@pytest.mark.slow
def test_a_stopped_rank_ends_an_evaluation_naming_it_and_resume_finishes_it(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """SIGSTOP to rank 0 (it writes the partial file) once its first records are in: rank 1 ends within the timeout
    naming it, instead of waiting in the next round's gather for the process group's timeout; `--resume` then
    gives every row once."""
    output = tmp_path / "result.json"
    args = [*EVALUATION, "--model_name_or_path", str(tiny_model_path), "--output", str(output)]
    process = launch(*args)
    try:
        partial, started = partial_path(output), time.monotonic()
        while not (partial.exists() and len(partial.read_text().splitlines()) >= 2):  # metadata, a first record
            assert process.poll() is None, process.communicate()[1][-4000:]
            assert time.monotonic() - started < 240, "no record within 240 s"
            time.sleep(0.1)
        pids = workers(process.pid)
        assert sorted(pids) == [0, 1], pids
        stderr = stop_rank_0_and_check_the_launch_ends(process, pids)
    finally:
        end_the_launch(process)
    assert "continue with --resume" in stderr and "--resume_from_checkpoint" not in stderr
    assert not output.exists() and len(partial.read_text().splitlines()) < 25, "it finished before the stop"
    run_script([*LAUNCH, *args, "--resume"], timeout=300)
    records = json.loads(output.read_text())["records"]
    assert len(records) == 24 and len({record["id"] for record in records}) == 24
    assert not partial.exists()
