"""Experiment trackers beyond TensorBoard: a recipe with `report_to: [tensorboard, <tracker>]` records in the tracker,
offline, every scalar TensorBoard records, with the same values at the same steps: the loss, each reward part
(`rewards/<name>/mean`) and the held-out accuracy curve (`holdout/...`, logged through `Trainer.log`).

The trackers are the `trackers` extra, installed in this environment (tests_integrations/make_env.sh), not in `.venv`
(trackio caps pillow below 13, swanlab protobuf below 7); missing, the test fails and says so. Both run with
no network: SwanLab in offline mode (`SWANLAB_MODE=offline`: a `run-<time>-<id>/backup.swanlab` record file per run
under `SWANLAB_LOG_DIR`, uploadable later with `swanlab sync`), Trackio locally (one SQLite database per project under
`TRACKIO_DIR`, no Space). The run is guarded (tests/guard/sitecustomize.py): a connection attempt fails the test.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sqlite3
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, run_python
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

GUARD = REPO / "tests" / "guard"
SHAPING_PLUGIN = '''
from vision_grpo.rewards import completion_texts, reward


@reward()
def tracker_length_shaping(completions, **kwargs):
    """Test only: characters / 10, so the rewards, the advantages and the loss vary from step to step."""
    return [len(text) / 10 for text in completion_texts(completions)]
'''
REWARDS = ["count_correct", "count_format", "tracker_length_shaping"]
STEPS = 2
# What a run must log, TensorBoard's tags (transformers' `rewrite_logs` puts training logs under `train/`).
REQUIRED = [
    "train/loss",
    "train/holdout/accuracy",
    "train/holdout/rewards/tracker_length_shaping",
    *(f"train/rewards/{name}/mean" for name in REWARDS),
]
# Logged once at the end of training; the trackers' callbacks keep them out of the curves (SwanLab logs them as
# `single_value/<name>`, Trackio not at all).
SINGLE_VALUES = {f"train/{name}" for name in ("train_runtime", "train_samples_per_second", "train_steps_per_second")}
SINGLE_VALUES |= {"train/train_loss", "train/total_flos"}
PROJECT = "vision-grpo-trackers-test"

Curves = dict[str, set[tuple[int, float]]]


def tensorboard_curves(run_dir: Path) -> Curves:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {(e.step, _same(e.value)) for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def swanlab_curves(logs: Path) -> Curves:
    """The scalar records of the run's offline backup file (what `swanlab sync` uploads), read with SwanLab's own
    reader: one JSON document per record. SwanLab's callback logs with `step=state.global_step`."""
    with warnings.catch_warnings():  # swanlab 0.7 nests classes in an Enum: a DeprecationWarning since Python 3.11
        warnings.simplefilter("ignore", DeprecationWarning)
        from swanlab.data.porter.datastore import DataStore

    (path,) = logs.glob("run-*/backup.swanlab")
    store, curves = DataStore(), {}
    store.open_for_scan(str(path))
    try:
        for text in store:
            record = json.loads(text)
            if record["model_type"] == "Scalar":
                scalar = record["data"]
                curves.setdefault(scalar["key"], set()).add((scalar["step"], _same(scalar["metric"]["data"])))
    finally:
        store.close()
    return curves


def trackio_curves(trackio_dir: Path, run_name: str) -> Curves:
    """The run's rows in the project's SQLite database. Trackio numbers its own steps (one per `log` call, and the
    held-out evaluation is a call of its own); transformers' callback adds `train/global_step` to every row."""
    with sqlite3.connect(trackio_dir / f"{PROJECT}.db") as db:
        rows = db.execute("SELECT metrics FROM metrics WHERE run_name = ? ORDER BY id", (run_name,)).fetchall()
    curves: Curves = {}
    for (text,) in rows:
        metrics = json.loads(text)
        step = metrics.pop("train/global_step", None)
        if step is None:  # TRL's `profiling/...` timings, logged straight to Trackio, not through the callbacks
            continue
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                curves.setdefault(key, set()).add((step, _same(value)))
    return curves


def _same(value: float) -> float:
    """TensorBoard stores float32; NaN as a string, so that NaN equals NaN."""
    value = float(np.float32(value))
    return "nan" if math.isnan(value) else value


def tracker_environment(tracker: str, tmp_path: Path) -> dict[str, str]:
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(GUARD), os.environ.get("PYTHONPATH")) if p),
        "VISION_GRPO_GUARD_LOG": str(tmp_path / "guard.jsonl"),
    }
    if tracker == "swanlab":
        # `offline`: records to disk only. (`local` also serves a dashboard and needs `swanlab[dashboard]`.)
        env.update({"SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": str(tmp_path / "swanlog")})
        env.update({"SWANLAB_SAVE_DIR": str(tmp_path / "swanlab-home"), "SWANLAB_PROJECT": PROJECT})
    else:
        env.update({"TRACKIO_DIR": str(tmp_path / "trackio")})
    return env


@pytest.mark.slow
@pytest.mark.parametrize("tracker", ["swanlab", "trackio"])
def test_a_tracker_records_the_scalars_tensorboard_records(
    tracker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if importlib.util.find_spec(tracker) is None:
        pytest.fail(f"{tracker} is not installed: run `make test-integrations` (its venv has the `trackers` extra)")
    for remote in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "SWANLAB_API_KEY"):  # a user's remote, if set
        monkeypatch.delenv(remote, raising=False)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "tracker_shaping.py").write_text(SHAPING_PLUGIN)
    overrides = {
        "--output_dir": str(tmp_path / "runs"),
        "--run_name": tracker,
        "--project": PROJECT,
        "--max_steps": str(STEPS),
        "--shapes_train_size": "8",
        "--shapes_eval_size": "4",
        "--per_device_train_batch_size": "4",
        "--num_generations": "4",
        "--max_completion_length": "8",
        "--save_strategy": "no",
        "--token_check_samples": "4",
        "--holdout_eval_steps": "1",
        "--holdout_eval_size": "4",
        "--per_device_eval_batch_size": "4",
        "--reward_dirs": str(plugins),
    }
    # The shipped CPU recipe with one change, as a user makes it (on the command line `--report_to` takes one name).
    recipe = yaml.safe_load((REPO / "recipes" / "shapes" / "tiny_cpu.yaml").read_text())
    recipe["report_to"] = ["tensorboard", tracker]
    (tmp_path / "tiny_cpu.yaml").write_text(yaml.safe_dump(recipe))
    lists = ["--reward_funcs", *REWARDS, "--reward_weights", "1", "0", "1"]
    flags = [item for pair in overrides.items() for item in pair]
    args = ["recipes/train.py", "--config", str(tmp_path / "tiny_cpu.yaml"), *flags, *lists]
    run_python(args, timeout=300, env=tracker_environment(tracker, tmp_path))

    records = [json.loads(line) for line in (tmp_path / "guard.jsonl").read_text().splitlines()]
    assert any("recipes/train.py" in r["detail"] for r in records if r["kind"] == "installed"), "ran unguarded"
    connections = [r for r in records if r["kind"] == "network"]
    assert connections == [], json.dumps(connections, indent=1)

    expected = tensorboard_curves(tmp_path / "runs" / tracker)
    for tag in REQUIRED:
        assert tag in expected, f"TensorBoard has no {tag}: {sorted(expected)}"
    assert {step for step, _ in expected["train/holdout/accuracy"]} == set(range(STEPS + 1))
    assert {step for step, _ in expected["train/loss"]} == set(range(1, STEPS + 1))

    if tracker == "swanlab":
        recorded = swanlab_curves(tmp_path / "swanlog")
    else:
        recorded = trackio_curves(tmp_path / "trackio", tracker)
    for tag in sorted(set(expected) - SINGLE_VALUES):
        assert recorded.get(tag) == expected[tag], f"{tracker} {tag}: {recorded.get(tag)}, TensorBoard {expected[tag]}"
