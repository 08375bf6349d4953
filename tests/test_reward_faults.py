"""Reward plugins that misbehave on some rows: by default the step stops naming the plugin, the row, the completion
and the value; with `reward_faults: skip` exactly those completions get no reward (and so no advantage) and are
counted; a call past `reward_timeout` is stopped. Never a NaN into TRL in silence.
"""

from __future__ import annotations

import json
import math
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import run_script

from vision_grpo.plugins.reward_faults import FaultPolicy
from vision_grpo.rewards import RewardPluginError, get_reward_funcs

IDS = ["row-a", "row-b", "row-c", "row-d"]
TEXTS = ["1", "bad", "2", "3"]  # the plugins below misbehave on the completion "bad" only: row-b, completion 1
COMPLETIONS = [[{"role": "assistant", "content": text}] for text in TEXTS]
SKIP = FaultPolicy(skip=True)


def plugin(folder: Path, on_bad: str, name: str | None = None) -> str:
    """A reward that scores 1.0, except that on the completion "bad" it does `on_bad` (an expression or statement
    giving `value`)."""
    name = name or f"flaky_{uuid.uuid4().hex[:10]}"
    body = f"""
        import math, time
        from vision_grpo.rewards import completion_texts, reward


        @reward()
        def {name}(completions, **kwargs):
            values = []
            for text in completion_texts(completions):
                value = 1.0
                if text == "bad":
                    {on_bad}
                values.append(value)
            return values
        """
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    return name


ROW_FAULTS = {
    "raises": ("raise ValueError('no box in it')", "raised ValueError: no box in it"),
    "NaN": ("value = float('nan')", "returned nan"),
    "inf": ("value = -math.inf", "returned -inf"),
    "a string": ("value = '0.5'", "returned '0.5'"),
    "a list": ("value = [1.0]", "returned [1.0]"),
}


@pytest.mark.parametrize(("on_bad", "said"), ROW_FAULTS.values(), ids=ROW_FAULTS.keys())
def test_a_fault_on_one_row_names_the_plugin_row_completion_and_value(tmp_path: Path, on_bad: str, said: str) -> None:
    name = plugin(tmp_path, on_bad)
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path])
    with pytest.raises(RewardPluginError) as error:
        func(completions=COMPLETIONS, id=IDS)
    message = str(error.value)
    assert message.startswith(f"reward `{name}` ({(tmp_path / f'{name}.py').resolve()}) {said}")
    assert f"{said} for row id=row-b (completion 1 of 4)" in message and "row-a" not in message
    assert ("rewards must be" in message) == ("returned" in said)  # why a value is refused
    assert "reward_faults: skip" in message  # the way out


@pytest.mark.parametrize(("on_bad", "said"), ROW_FAULTS.values(), ids=ROW_FAULTS.keys())
def test_skip_leaves_exactly_the_faulty_completions_unscored(
    tmp_path: Path, on_bad: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = plugin(tmp_path, on_bad)
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path], policy=SKIP)
    assert func(completions=COMPLETIONS, id=IDS) == [1.0, None, 1.0, 1.0]
    assert func.reward_round.take_skipped() == [False, True, False, False]
    assert func.reward_round.take_skipped() is None  # taken once
    assert f"{said} for row id=row-b (completion 1 of 4)" in caplog.text and "skipped" in caplog.text


def test_a_skipped_completion_is_not_one_that_no_reward_scored(tmp_path: Path) -> None:
    """A completion skipped by one reward's fault and left None by the other is meant to get nothing: no error. A
    completion that no reward scored, without a fault, still is one."""
    flaky = plugin(tmp_path, "value = float('nan')")
    other = plugin(tmp_path, "value = None")  # "not mine" on the faulty row only
    first, second = get_reward_funcs([flaky, other], extra_dirs=[tmp_path], policy=SKIP)
    assert first(completions=COMPLETIONS, id=IDS) == [1.0, None, 1.0, 1.0]
    assert second(completions=COMPLETIONS, id=IDS) == [1.0, None, 1.0, 1.0]
    assert first.reward_round.take_skipped() == [False, True, False, False]
    (alone,) = get_reward_funcs([other], extra_dirs=[tmp_path], policy=SKIP)
    with pytest.raises(RewardPluginError, match=r"no reward scored 1 of 4 completions \(rows id=row-b\)"):
        alone(completions=COMPLETIONS, id=IDS)


def test_a_call_that_faults_as_a_whole_names_its_rows_and_skip_skips_them_all(tmp_path: Path) -> None:
    name = f"short_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(
        f"from vision_grpo.rewards import reward\n\n\n@reward()\ndef {name}(completions, **kwargs):\n    return [1.0]\n"
    )
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path])
    with pytest.raises(RewardPluginError, match=r"returned 1 values for 4 completions on rows id=row-a, row-b, row-c"):
        func(completions=COMPLETIONS, id=IDS)
    (skipping,) = get_reward_funcs([name], extra_dirs=[tmp_path], policy=SKIP)
    assert skipping(completions=COMPLETIONS, id=IDS) == [None] * 4
    assert skipping.reward_round.take_skipped() == [True] * 4


@pytest.mark.parametrize(
    "on_bad",
    [
        "time.sleep(60)",
        "while True: pass",
        "try:\n" + " " * 24 + "time.sleep(60)\n" + " " * 20 + "except Exception:\n" + " " * 24 + "value = 0.0",
    ],
    ids=["sleeps", "loops", "catches Exception"],
)
def test_a_reward_past_its_time_limit_is_stopped_and_named(tmp_path: Path, on_bad: str) -> None:
    name = plugin(tmp_path, on_bad)
    (func,) = get_reward_funcs([name], extra_dirs=[tmp_path], policy=FaultPolicy(timeout=0.5))
    start = time.monotonic()
    with pytest.raises(RewardPluginError, match=r"took more than 0.5 s \(reward_timeout\) and was stopped on rows"):
        func(completions=COMPLETIONS, id=IDS)
    assert time.monotonic() - start < 10
    (skipping,) = get_reward_funcs([name], extra_dirs=[tmp_path], policy=FaultPolicy(skip=True, timeout=0.5))
    assert skipping(completions=COMPLETIONS, id=IDS) == [None] * 4
    time.sleep(0.7)  # a late signal from a finished call raises nothing
    assert func.__name__ == name


def test_a_time_limit_leaves_math_verify_s_own_alarm_working() -> None:
    """`math_verify` times its parsing with SIGALRM inside each call; the reward time limit must not break it."""
    (func,) = get_reward_funcs(["vqa_answer"], policy=FaultPolicy(timeout=30))
    completions = [[{"role": "assistant", "content": r"so \boxed{2\sqrt{3}}"}], [{"role": "assistant", "content": "7"}]]
    values = func(completions=completions, answer=[r"\sqrt{12}", "8"], answer_type=["math", "math"], tolerance=[0, 0])
    assert values == [1.0, 0.0]


FLAKY_TRAINING_PLUGIN = '''
import math, os
from vision_grpo.rewards import reward


@reward()
def flaky_on_some_rows(completions, id, **kwargs):
    """Test only: NaN for the rows whose id ends in 1 or 5, and a record of how many NaNs it returned."""
    values = [math.nan if str(row).endswith(("1", "5")) else 0.0 for row in id]
    with open(os.environ["FLAKY_LOG"], "a") as log:
        log.write(f"{sum(math.isnan(v) for v in values)}\\n")
    return values
'''


@pytest.mark.slow
def test_training_with_skip_counts_the_skipped_completions_and_keeps_the_loss_finite(tmp_path: Path) -> None:
    """The count the trainer reports (metric and manifest) is the plugin's own count of NaNs; the run ends, its loss
    is a number at every step. Without `reward_faults: skip` the same plugin stops the run at its first NaN."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "flaky.py").write_text(FLAKY_TRAINING_PLUGIN)
    log = tmp_path / "flaky.log"
    args = ["recipes/train.py", "--config", "recipes/shapes/tiny_cpu.yaml", "--output_dir", str(tmp_path / "runs")]
    args += ["--reward_dirs", str(plugins), "--reward_funcs", "count_correct", "flaky_on_some_rows"]
    args += ["--reward_weights", "1", "1", "--max_steps", "3", "--logging_steps", "1", "--save_steps", "3"]
    args += ["--shapes_train_size", "16", "--token_check_samples", "1", "--report_to", "none"]
    failed = run_script([*args, "--run_name", "fail"], env={"FLAKY_LOG": str(log)}, check=False)
    assert failed.returncode == 1
    assert "RewardPluginError: reward `flaky_on_some_rows`" in failed.stderr
    assert "returned nan for row id=" in failed.stderr and "rewards must be finite" in failed.stderr
    log.unlink()
    run_script([*args, "--run_name", "skip", "--reward_faults", "skip"], env={"FLAKY_LOG": str(log)})
    returned = sum(int(line) for line in log.read_text().split())
    run_dir = tmp_path / "runs" / "skip"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert returned > 0 and manifest["skipped_completions"] == returned
    history = json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    steps = [entry for entry in history if "loss" in entry]
    assert len(steps) == 3 and all(math.isfinite(entry["loss"]) for entry in steps)
    assert sum(entry["rewards/skipped_completions"] for entry in steps) == returned


OUTAGE_PLUGIN = '''
import os
from vision_grpo.rewards import completion_texts, reward


@reward()
def down_for_a_while(completions, trainer_state, **kwargs):
    """Test only: a score that varies between completions, except at the steps listed in OUTAGE_STEPS, where every
    call raises (a service that is down)."""
    if str(trainer_state.global_step + 1) in os.environ["OUTAGE_STEPS"].split(","):
        raise ConnectionError("the scoring service is down")
    return [float(len(text) % 2) for text in completion_texts(completions)]
'''


@pytest.mark.slow
def test_a_step_without_any_reward_makes_no_update_and_an_outage_stops_the_run(tmp_path: Path) -> None:
    """`reward_faults: skip` survives a reward's outage: steps 2 and 3 lose every completion, leave the adapter as
    step 1 left it (AdamW's moments would have moved it on zero gradients), are counted; step 4 trains again. The
    same outage with `reward_outage_steps: 2` stops the run naming the key. Before: the first such step ended the
    run."""
    from safetensors.torch import load_file

    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "down.py").write_text(OUTAGE_PLUGIN)
    args = ["recipes/train.py", "--config", "recipes/shapes/tiny_cpu.yaml", "--output_dir", str(tmp_path / "runs")]
    args += ["--reward_dirs", str(plugins), "--reward_funcs", "down_for_a_while", "--reward_weights", "1"]
    args += ["--max_steps", "4", "--save_steps", "1", "--save_total_limit", "4", "--shapes_train_size", "16"]
    args += ["--token_check_samples", "1", "--report_to", "none", "--reward_faults", "skip"]
    env = {"OUTAGE_STEPS": "2,3"}
    run_script([*args, "--run_name", "survives"], env=env)
    run_dir = tmp_path / "runs" / "survives"
    adapters = [load_file(run_dir / f"checkpoint-{step}" / "adapter_model.safetensors") for step in (1, 2, 3, 4)]

    def same(a: dict, b: dict) -> bool:
        return all(torch.equal(a[key], b[key]) for key in a)

    assert same(adapters[0], adapters[1]) and same(adapters[0], adapters[2]) and not same(adapters[2], adapters[3])
    assert json.loads((run_dir / "manifest.json").read_text())["skipped_steps"] == 2
    history = json.loads((run_dir / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    assert [entry["rewards/skipped_step"] for entry in history if "loss" in entry] == [0.0, 1.0, 1.0, 0.0]
    failed = run_script([*args, "--run_name", "stops", "--reward_outage_steps", "2"], env=env, check=False)
    assert failed.returncode == 1
    assert "2 step(s) in a row (reward_outage_steps: 2): the reward looks down" in failed.stderr


def test_a_weighted_total_that_is_not_finite_stops_naming_the_reward() -> None:
    """Every value finite, the weighted sum not: 3e38 twice overflows float32 (TRL's reward tensor); NaN (a skipped
    completion) is left to the skip logic."""
    from vision_grpo.training.trainer import refuse_infinite_totals

    weights = torch.tensor([1.0, 2.0])
    fine = torch.tensor([[1.0, 0.5], [math.nan, 1.0]])
    refuse_infinite_totals(fine, weights, ["a", "b"])
    overflow = torch.tensor([[1.0, 0.5], [1.0, 3e38]])
    with pytest.raises(RewardPluginError, match=r"reward `b`: its value 3e\+38 times its weight 2 makes the weighted"):
        refuse_infinite_totals(overflow, weights, ["a", "b"])
