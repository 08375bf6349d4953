"""Experiment 3 (`make experiment-perception`): its recipes, the compute curve's checkpoints, and the experiment end to
end at toy size, its section joining a report that other commands wrote into the same folder."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from vision_grpo.demo.curve import checkpoints
from vision_grpo.demo.experiments import CURVE_POINTS, EXPERIMENTS
from vision_grpo.demo.stages import curve_checkpoints

REPO = Path(__file__).resolve().parent.parent
(PERCEPTION,) = [e for e in EXPERIMENTS if e.key == "perception"]


def _recipe(path: str) -> dict:
    return yaml.safe_load((REPO / path).read_text(encoding="utf-8"))


def test_both_arms_train_on_the_warm_starts_images_and_are_scored_on_others() -> None:
    """GRPO and the SFT control differ in how they learn, not in what they see: the GRPO recipe draws the warm
    start's task and training images, and the held-out images (the GRPO recipe's) have a seed of their own."""
    sft, grpo = _recipe(PERCEPTION.sft_recipe), _recipe(PERCEPTION.grpo_recipe)
    task = [k for k in sft if k.startswith("shapes_") or k in ("task", "vision_tower", "model_name_or_path")]
    assert {k: grpo[k] for k in task} == {k: sft[k] for k in task}
    assert grpo["shapes_eval_seed"] != grpo["shapes_train_seed"] and grpo["shapes_eval_size"] >= 300
    assert sft["shapes_max_count"] == 5 and not sft["shapes_fixed_size"]  # the hard counts, random sizes
    assert grpo["reward_funcs"][0] == "count_boxed_correct" and grpo["reward_weights"][1:] == [0.0, 0.0]
    # GRPO's own checkpoints give the curve about as many points as the control's.
    assert grpo["max_steps"] // grpo["save_steps"] == CURVE_POINTS and grpo["save_total_limit"] >= CURVE_POINTS


def test_the_curve_reads_each_checkpoint_then_the_final_model(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (4, 8, 10):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    (run / "checkpoint-2.partial").touch()  # not a checkpoint folder
    (run / "manifest.json").write_text(json.dumps({"global_step": 10, "ended": True}))
    assert checkpoints(run) == [(4, run / "checkpoint-4"), (8, run / "checkpoint-8"), (10, run)]
    options = curve_checkpoints(320)
    assert options[options.index("--save_steps") + 1] == "54"  # 320 / 6, rounded up: 6 checkpoints
    assert int(options[options.index("--save_total_limit") + 1]) > CURVE_POINTS
