"""The compare command (eval/compare_runs.py) and the sweep helper (recipes/sweep.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_script
from PIL import Image
from torch.utils.tensorboard import SummaryWriter

from vision_grpo.eval.compare_runs import compare, differing_keys, find_runs, load_runs, smooth

_spec = importlib.util.spec_from_file_location("sweep", REPO / "recipes" / "sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def make_run(path: Path, config: dict, scalars: dict[str, list[float]]) -> Path:
    """A run folder as train.py leaves it: TensorBoard scalars (steps 1..n) and the resolved recipe."""
    path.mkdir(parents=True)
    with SummaryWriter(log_dir=str(path)) as writer:
        for tag, values in scalars.items():
            for step, value in enumerate(values, start=1):
                writer.add_scalar(tag, value, step)
    (path / "recipe.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def table_rows(markdown: str) -> dict[str, list[str]]:
    """Markdown table rows by their first cell."""
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("|")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def test_differing_keys_are_exactly_the_changed_ones():
    base = {"output_dir": "runs/a/r1", "run_name": "r1", "learning_rate": 1e-5, "reward_weights": [1.0, 0.5]}
    other = {**base, "output_dir": "runs/a/r2", "run_name": "r2", "learning_rate": 4e-5}
    assert differing_keys([base, other]) == ["learning_rate"]
    assert differing_keys([base, dict(base)]) == []
    assert differing_keys([base, {**base, "reward_weights": [1.0, 0.2]}]) == ["reward_weights"]
    assert differing_keys([base, {**base, "beta": 0.04}]) == ["beta"]  # set in one run only


def test_smoothing_is_tensorboards_debiased_average():
    assert smooth([3.0, 1.0, 2.0], 0.0) == [3.0, 1.0, 2.0]
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no pull towards zero
    assert smooth([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])


def test_table_and_png_from_event_files(tmp_path):
    common = {"output_dir": "x", "seed": 42, "beta": 0.0}
    make_run(
        tmp_path / "shapes" / "tiny" / "a",
        {**common, "run_name": "a", "learning_rate": 1e-5},
        {"train/reward": [0.1, 0.5, 0.3], "train/completions/clipped_ratio": [0.9, 0.2, 0.4], "train/other": [1, 2]},
    )
    make_run(
        tmp_path / "shapes" / "tiny" / "b",
        {**common, "run_name": "b", "learning_rate": 4e-5},
        {"train/reward": [0.2, 0.2, 0.4], "train/completions/clipped_ratio": [0.5, 0.5, 0.5]},
    )
    (tmp_path / "shapes" / "tiny" / "notes.txt").write_text("a file a glob may match", encoding="utf-8")
    runs = find_runs([str(p) for p in sorted((tmp_path / "shapes" / "tiny").iterdir())])
    assert [p.name for p in runs] == ["a", "b"]

    png, markdown = compare([str(tmp_path / "shapes")], tmp_path / "out" / "cmp.v1")  # a folder above: searched
    assert png == tmp_path / "out" / "cmp.v1.png" and markdown == tmp_path / "out" / "cmp.v1.md"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width > 300 and image.height > 200
    rows = table_rows(markdown.read_text(encoding="utf-8"))
    assert rows[""] == ["a", "b"]
    assert [key for key in rows if key.startswith("`")] == ["`learning_rate`"]
    assert rows["`learning_rate`"] == ["1e-05", "4e-05"]
    assert rows["steps"] == ["3", "3"]
    assert rows["reward (final)"] == ["0.3", "0.4"]
    assert rows["reward (best, max)"] == ["0.5", "0.4"]
    assert rows["completions/clipped_ratio (best, min)"] == ["0.2", "0.5"]
    assert not any("other" in key for key in rows)  # only the main metrics


def test_labels_tell_same_named_runs_apart(tmp_path):
    for recipe in ("r1", "r2"):
        make_run(tmp_path / recipe / "run", {"learning_rate": 1e-5}, {"train/reward": [0.0, 1.0]})
    runs = load_runs(find_runs([str(tmp_path)]))
    assert [run.label for run in runs] == ["r1/run", "r2/run"]
    with pytest.raises(FileNotFoundError):
        find_runs([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="no TensorBoard event files"):
        find_runs([str(tmp_path / "r1" / "run" / "recipe.yaml")])


def test_sweep_plans_every_combination_with_readable_names():
    flags = sweep.split_flags(
        ["--config", "c.yaml", "--learning_rate", "1e-5,4e-5", "--beta=0,0.04", "--reward_weights", "1", "0.5"]
    )
    runs = sweep.plan(flags, "s")
    assert [name for name, _ in runs] == [
        "s_learning_rate=1e-5_beta=0",
        "s_learning_rate=1e-5_beta=0.04",
        "s_learning_rate=4e-5_beta=0",
        "s_learning_rate=4e-5_beta=0.04",
    ]
    name, args = runs[1]
    assert args == [
        "--config", "c.yaml", "--reward_weights", "1", "0.5",
        "--learning_rate", "1e-5", "--beta", "0.04", "--run_name", name,
    ]  # fmt: skip
    json_flag = sweep.split_flags(["--chat_template_kwargs", '{"a": 1, "b": 2}'])
    with pytest.raises(sweep.SweepError, match="nothing to sweep"):
        sweep.plan(json_flag, "s")
    with pytest.raises(sweep.SweepError, match="--sweep_name"):
        sweep.plan(sweep.split_flags(["--lr", "1,2", "--run_name", "x"]), "s")


def test_sweep_refuses_to_reuse_run_folders(tmp_path):
    (tmp_path / "s_learning_rate=1e-5").mkdir()
    args = ["--config", "recipes/shapes/tiny_cpu.yaml", "--output_dir", str(tmp_path), "--learning_rate", "1e-5,2e-5"]
    with pytest.raises(sweep.SweepError, match="already exist"):
        sweep.main([*args, "--sweep_name", "s", "--dry_run"])
    assert sweep.main([*args, "--sweep_name", "t", "--dry_run"]) == []  # a dry run trains nothing


@pytest.mark.slow
def test_two_learning_rates_give_two_runs_and_a_comparison(tmp_path):
    """The issue's check: a real 2-step sweep over two learning rates, then the PNG and the differing-keys table."""
    output_dir = tmp_path / "runs" / "shapes" / "tiny_cpu"
    run_script(
        [
            "recipes/sweep.py",
            "--config", "recipes/shapes/tiny_cpu.yaml",
            "--learning_rate", "1e-5,4e-5",
            "--sweep_name", "lr",
            "--output_dir", str(output_dir),
            "--compare_output", str(tmp_path / "compare"),
            "--max_steps", "2",
            "--save_steps", "100",
            "--shapes_train_size", "16",
            "--shapes_eval_size", "4",
            "--holdout_eval_steps", "1",
            "--holdout_eval_size", "4",
        ],
        timeout=900,
    )  # fmt: skip
    names = ["lr_learning_rate=1e-5", "lr_learning_rate=4e-5"]
    assert sorted(p.name for p in output_dir.iterdir()) == names
    for name, rate in zip(names, (1e-5, 4e-5), strict=True):
        run = output_dir / name
        assert any(run.glob("events.out.tfevents.*"))
        assert yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8"))["learning_rate"] == rate
        manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
        assert manifest["seed"] == 42 and manifest["dataset"]["shapes_eval_size"] == 4 and manifest["ended"]

    with Image.open(tmp_path / "compare.png") as image:
        assert image.format == "PNG" and image.width > 300
    rows = table_rows((tmp_path / "compare.md").read_text(encoding="utf-8"))
    assert rows[""] == names
    assert [key for key in rows if key.startswith("`")] == ["`learning_rate`"]
    assert rows["steps"] == ["2", "2"]
    for metric in ("reward (final)", "holdout/accuracy (final)", "completions/mean_length (final)"):
        assert all(value != "–" for value in rows[metric]), metric
