"""The compare command (eval/compare_runs.py) and the sweep helper (recipes/sweep.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, entry_point, run_script
from PIL import Image
from torch.utils.tensorboard import SummaryWriter

from vision_grpo.evaluation.training_curves import (
    Run,
    compare,
    compare_group,
    curves_figure,
    differing_keys,
    find_runs,
    legend_label,
    load_runs,
    smooth,
)
from vision_grpo.recipe.arguments import RecipeError

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

    pngs, markdown = compare([str(tmp_path / "shapes")], tmp_path / "out" / "cmp.v1")  # a folder above: searched
    assert pngs == [tmp_path / "out" / "cmp.v1.png"] and markdown == tmp_path / "out" / "cmp.v1.md"
    png = pngs[0]
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
    assert "Not drawn" not in markdown.read_text(encoding="utf-8")  # both metrics move in some run


def test_sft_and_grpo_runs_are_compared_apart(tmp_path):
    make_run(tmp_path / "sft" / "warm", {"learning_rate": 3e-3}, {"train/loss": [2.0, 1.0], "train/entropy": [3, 1]})
    make_run(tmp_path / "grpo" / "a", {"learning_rate": 2e-5}, {"train/reward": [0.1, 0.5], "train/entropy": [1, 1]})
    make_run(tmp_path / "grpo" / "b", {"learning_rate": 2e-4}, {"train/reward": [0.1, 0.9], "train/entropy": [1, 1]})
    pngs, markdown = compare([str(tmp_path)], tmp_path / "cmp")
    assert pngs == [tmp_path / "cmp_grpo.png", tmp_path / "cmp_sft.png"]
    text = markdown.read_text(encoding="utf-8")
    grpo, sft = text.split("## SFT runs (1)")
    assert "## GRPO runs (2)" in grpo and "warm" not in grpo and "sft/warm" in sft
    assert "Not drawn (flat: entropy)" in grpo  # 1.0 everywhere in both GRPO runs
    assert "loss (final)" in sft and "loss" not in grpo


def grpo_run(name: str, config: dict, scalars: dict[str, list[float]]) -> Run:
    return Run(Path(name), name, config, {tag: list(enumerate(values)) for tag, values in scalars.items()})


def test_only_curves_that_differ_are_drawn(tmp_path):
    moving = [0.1, 0.4, 0.8]
    runs = [
        grpo_run("a", {}, {"train/reward": moving, "train/rewards/x/mean": moving, "train/kl": [0, 0, 0]}),
        grpo_run("b", {}, {"train/reward": moving, "train/rewards/x/mean": moving, "train/kl": [0, 0, 0]}),
    ]
    png, section = compare_group(runs, tmp_path / "c", smoothing=0.0)
    assert png is None  # the only moving curve is the same in both runs
    assert "the same in every run: reward, rewards/x/mean" in section and "flat: kl" in section
    runs[1].scalars["train/reward"] = runs[1].scalars["train/rewards/x/mean"] = list(enumerate([0.2, 0.3, 0.3]))
    png, section = compare_group(runs, tmp_path / "c", smoothing=0.0)
    assert png is not None and "as reward: rewards/x/mean" in section  # the only weighted part = the reward


def test_legend_labels_are_short_and_stay_inside_the_figure():
    keys = ["learning_rate", "model_name_or_path", "shapes_eval_size", "temperature"]
    config = {"model_name_or_path": "runs/shapes/tiny_sft/a-long-warm-start-name", "shapes_eval_size": 300}
    runs = [
        grpo_run(f"sweep_learning_rate={rate}", {**config, "learning_rate": rate}, {"train/reward": [0, i, 1]})
        for i, rate in enumerate((1e-5, 2e-5, 6e-5, 1e-4, 2e-4))
    ]
    label = legend_label(runs[0], keys)
    assert label == (
        "sweep_learning_rate=1e-05 (model_name_or_path=runs/shapes/tiny_sft/a-long-warm-start-name, "
        "shapes_eval_size=300)"
    )  # not learning_rate again (the name shows it), not temperature (unset in this run)
    figure = curves_figure(runs, keys, ["train/reward"], smoothing=0.0)
    figure.draw_without_rendering()
    box, frame = figure.legends[0].get_window_extent(), figure.bbox
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0
    (axis,) = [axis for axis in figure.axes if axis.has_data()]
    assert box.y1 <= axis.get_tightbbox().y0  # below the panels, not over them


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


def test_sweep_checks_every_runs_flags_before_the_first_starts(tmp_path):
    args = ["--config", "recipes/shapes/tiny_cpu.yaml", "--output_dir", str(tmp_path), "--learning_rat", "1e-5,2e-5"]
    with pytest.raises(RecipeError, match="unknown flag `--learning_rat`; did you mean `--learning_rate`"):
        sweep.main([*args, "--sweep_name", "s"])  # not a dry run: it would have started training
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ("2e-5,4e-5,2e-5", "--learning_rate gives 2e-5"),
        ("1e-4,0.0001", "--learning_rate gives 1e-4 and 0.0001, the same number,"),
    ],
)
def test_a_value_swept_twice_is_refused_before_the_first_run(tmp_path, values, message):
    """Before: the same run trained twice, or the second refused for its taken folder after the first had finished."""
    args = ["--config", "recipes/shapes/tiny_cpu.yaml", "--output_dir", str(tmp_path), "--learning_rate", values]
    with pytest.raises(sweep.SweepError, match=rf"{message} twice: the runs would repeat each other; give each value"):
        sweep.main([*args, "--sweep_name", "s", "--dry_run"])  # refused while planning, before any run could start
    assert not any(tmp_path.iterdir())


def test_a_sweep_of_a_folder_or_a_binary_recipe_names_it(tmp_path):
    """Before: `IsADirectoryError` and a `UnicodeDecodeError` traceback, reading the recipe for its output_dir."""
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    for recipe, what in ((tmp_path, "is a folder, not a recipe file"), (binary, "is a binary file, not YAML")):
        with pytest.raises(RecipeError, match=f"recipe {recipe} {what}"):
            sweep.main(["--config", str(recipe), "--learning_rate", "1e-5,2e-5", "--sweep_name", "s"])


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
        assert manifest["seed"] == 42 and manifest["dataset"]["eval"]["size"] == 4 and manifest["ended"]

    # A random-weight model earns no reward, so the two learning rates train alike: nothing differs to draw, and the
    # comparison says so instead of drawing identical lines.
    markdown = (tmp_path / "compare.md").read_text(encoding="utf-8")
    assert not (tmp_path / "compare.png").exists()
    assert "flat: reward" in markdown and "the same in every run: completions/mean_length" in markdown
    rows = table_rows(markdown)
    assert rows[""] == names
    assert [key for key in rows if key.startswith("`")] == ["`learning_rate`"]
    assert rows["steps"] == ["2", "2"]
    for metric in ("reward (final)", "holdout/accuracy (final)", "completions/mean_length (final)"):
        assert all(value != "–" for value in rows[metric]), metric


def test_the_two_compare_commands_default_to_different_files(tmp_path, monkeypatch):
    """Running the README in order once lost `compare.py`'s chart: `compare_runs.py` wrote the same file names."""
    from test_compare import BASE, TRAINED

    compare_results, compare_runs = entry_point("eval/compare.py"), entry_point("eval/compare_runs.py")

    monkeypatch.chdir(tmp_path)
    for name, result in (("base", BASE), ("trained", TRAINED)):
        (tmp_path / f"{name}.json").write_text(json.dumps(result), encoding="utf-8")
    compare_results.main(["base.json", "trained.json"])
    make_run(tmp_path / "runs" / "a", {"learning_rate": 1e-5}, {"train/reward": [0.1, 0.5]})
    compare_runs.main(["runs"])
    written = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert written == ["eval_compare.md", "eval_compare.png", "runs_compare.md", "runs_compare.png"]


def test_run_kind_comes_from_the_logged_tags():
    assert grpo_run("g", {}, {"train/reward": [0.1]}).kind == "GRPO"
    assert grpo_run("h", {}, {"train/holdout/accuracy": [0.1]}).kind == "GRPO"  # stopped before its first reward
    assert grpo_run("s", {}, {"train/loss": [2.0], "train/mean_token_accuracy": [0.5]}).kind == "SFT"


def test_a_grpo_run_that_crashed_before_logging_a_reward_is_filed_as_grpo(tmp_path):
    """The manifest names the trainer before training starts; the tags alone filed such a run under "SFT runs"."""
    crashed = make_run(tmp_path / "crashed", {"learning_rate": 1e-3}, {"train/learning_rate": [1e-3]})
    (crashed / "manifest.json").write_text(json.dumps({"trainer": "VisionGRPOTrainer"}))
    sft = make_run(tmp_path / "sft", {"learning_rate": 1e-3}, {"train/loss": [2.0]})
    (sft / "manifest.json").write_text(json.dumps({"trainer": "SFTTrainer"}))
    assert [run.kind for run in load_runs([crashed, sft])] == ["GRPO", "SFT"]
