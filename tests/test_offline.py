"""Nothing reaches the network: training (two processes), the supervised warm start, evaluation, the run comparison
and the GeoQA data commands run with every socket to a non-loopback address blocked and only `HF_HUB_OFFLINE=1`
set (no `HF_DATASETS_OFFLINE`, no `HF_HUB_DISABLE_TELEMETRY`: telemetry must stay off because the Hub is offline).

The guard (tests/guard/sitecustomize.py) is put on PYTHONPATH, so Python imports it at start-up in every process,
including the ranks `accelerate launch` spawns and the interpreter that builds the embedded model. Each process
logs that it ran guarded; any connection attempt or unpickling is logged too, and fails the test.

Without a home (HOME empty or unset, as under cron or `env -i`) the caches go under the temporary directory, not the
filesystem root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_script

GUARD = REPO / "tests" / "guard"
CPU_LAUNCH_CONFIG = REPO / "accelerate_configs" / "cpu.yaml"
# torch.distributed exchanges Python objects between the ranks of one run (over loopback) by pickling them on one
# side and unpickling on the other; these bytes never come from a file or from outside the run.
RANK_EXCHANGE = "distributed_c10d.py"


@pytest.fixture
def guarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Guard every subprocess; fresh caches so the embedded model is built under the guard; returns the guard log."""
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_TELEMETRY", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("VISION_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(GUARD), os.environ.get("PYTHONPATH")) if p))
    log = tmp_path / "guard.jsonl"
    monkeypatch.setenv("VISION_GRPO_GUARD_LOG", str(log))
    # The guard is a sitecustomize, which only a starting interpreter loads: a fork of the preloaded server (whose
    # environment matches this one when this file starts it) would run unguarded.
    monkeypatch.setenv("VISION_GRPO_TEST_FRESH_INTERPRETERS", "1")
    return log


def guard_records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def test_the_guard_blocks_and_logs_connections_but_not_loopback(guarded: Path) -> None:
    probe = """
import pickle, socket, urllib.request
for attempt in (lambda: urllib.request.urlopen("https://huggingface.co", timeout=5),
                lambda: socket.create_connection(("8.8.8.8", 53), timeout=5)):
    try:
        attempt()
    except OSError as error:
        print("blocked:", error)
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
socket.create_connection(server.getsockname(), timeout=5).close()
pickle.loads(pickle.dumps([1]))
"""
    out = run_script(["-c", probe], timeout=60).stdout
    assert out.count("[Errno 101] network blocked by the test guard") == 2
    kinds = [(r["kind"], r["detail"]) for r in guard_records(guarded) if r["kind"] != "installed"]
    assert kinds == [
        ("network", "getaddrinfo 'huggingface.co'"),
        ("network", "getaddrinfo '8.8.8.8'"),
        ("pickle", "pickle.loads"),
    ]


@pytest.mark.slow
def test_training_evaluation_and_the_demo_pieces_make_no_connection(guarded: Path, tmp_path: Path) -> None:
    runs, tiny = tmp_path / "runs", {"--shapes_train_size": "4", "--max_steps": "1"}
    flags = [item for pair in tiny.items() for item in pair]
    sft = ["recipes/sft.py", "--config", "recipes/shapes/tiny_sft.yaml", "--output_dir", str(runs), "--run_name", "sft"]
    run_script([*sft, *flags, "--per_device_train_batch_size", "4"], timeout=600)  # also builds the tiny model

    launch = ["-m", "accelerate.commands.launch", "--config_file", str(CPU_LAUNCH_CONFIG)]
    grpo = ["recipes/train.py", "--config", "recipes/shapes/tiny_cpu.yaml", "--output_dir", str(runs), "--run_name"]
    grpo += ["grpo", *flags, "--per_device_train_batch_size", "4", "--max_completion_length", "8", "--save_steps", "1"]
    run_script([*launch, *grpo], timeout=600)

    result = tmp_path / "eval.json"
    evaluate = ["eval/evaluate.py", "--config", "recipes/shapes/tiny_cpu.yaml", "--adapter", str(runs / "grpo")]
    run_script([*evaluate, "--output", str(result), "--limit", "2", "--shapes_eval_size", "2"], timeout=600)
    assert len(json.loads(result.read_text())["records"]) == 2

    run_script(["eval/compare_runs.py", str(runs / "grpo"), str(runs / "sft"), "--output", str(tmp_path / "cmp")])
    fixture = tmp_path / "geoqa.parquet"
    run_script(["-m", "vision_grpo.data.geoqa_fixture", "--output", str(fixture), "--train-rows", "4"], timeout=300)
    prepare = ["-m", "vision_grpo.data.geoqa", "prepare", "--source", str(fixture), "--output-dir"]
    run_script([*prepare, str(tmp_path / "prepared")], timeout=300)

    records = guard_records(guarded)
    guarded_commands = [r["detail"] for r in records if r["kind"] == "installed"]
    for command in ("recipes/sft.py", "recipes/train.py", "eval/evaluate.py", "eval/compare_runs.py"):
        assert any(command in line for line in guarded_commands), f"{command} did not run guarded"
    assert sum("recipes/train.py" in line and "--config_file" not in line for line in guarded_commands) == 2  # ranks
    violations = [
        r for r in records if r["kind"] != "installed" and not any(RANK_EXCHANGE in frame for frame in r["stack"])
    ]
    assert violations == [], json.dumps(violations, indent=1)


@pytest.mark.parametrize("home", ["", None], ids=["empty", "unset"])
def test_without_a_home_every_cache_goes_under_the_temporary_directory(home: str | None, tmp_path: Path) -> None:
    """Before: with HOME empty, `/.cache/vision_grpo` and `/.cache/huggingface` (the root; with HOME unset, the
    passwd entry's home, which a container's user may not have)."""
    unset = ("HOME", "HF_HOME", "XDG_CACHE_HOME", "VISION_GRPO_CACHE", "HF_DATASETS_CACHE", "HF_HUB_CACHE")
    env = {key: value for key, value in os.environ.items() if key not in unset}
    env.update({"TMPDIR": str(tmp_path), **({} if home is None else {"HOME": home})})
    probe = """
import vision_grpo  # first, as every entry point imports it before huggingface_hub or datasets
import json, datasets.config, huggingface_hub.constants as hub
from vision_grpo.run.locks_and_digests import digest_cache_path
from vision_grpo.storage.cache_home import vision_grpo_cache
caches = [hub.HF_HUB_CACHE, datasets.config.HF_DATASETS_CACHE, vision_grpo_cache(), digest_cache_path()]
print(json.dumps([str(path) for path in caches]))
"""
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    caches = [Path(path) for path in json.loads(done.stdout)]
    assert all(path.is_relative_to(tmp_path / f"cache-{os.getuid()}") for path in caches), caches
