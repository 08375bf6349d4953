"""The plan under DeepSpeed: its weight, gradient and optimizer parts equal DeepSpeed's own estimators (offload
included) for a full fine-tune of the shipped 3B config, the ZeRO stage is the one `accelerate launch` hands the
processes (accelerate's own parser and environment, no launch), and the memory gate passes a ZeRO-2 run that DDP
could not hold."""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env
from deepspeed.runtime.zero.stage3 import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
)
from deepspeed.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
)
from test_plan import _fake_gpu, _recipe

from vision_grpo.plan import check as plan_check
from vision_grpo.plan import estimate as plan_build
from vision_grpo.plan.parts import GiB, Plan
from vision_grpo.plan.zero import Zero, model_state_parts
from vision_grpo.recipe.arguments import RecipeError

REPO = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
GPUS = 8
FULL_FT = ("--use_peft", "false", "--vision_tower", "train")  # every parameter trains, as the estimators assume


@pytest.fixture(scope="module")
def counts() -> dict[str, int]:
    return plan_build.parameter_counts(plan_build.model_config(MODEL), 0, False, None)


def _states_on_gpu(counts: dict[str, int], zero: Zero) -> float:
    parts = model_state_parts(counts, counts["total"], "bfloat16", 2, False, GPUS, zero)
    return Plan(MODEL, "", parts).phase_total("train")


def _printed_gpu_gib(estimate, *args) -> list[float]:
    """The per-GPU column of what an `..._all_cold` estimator prints, in its row order."""
    out = io.StringIO()
    with redirect_stdout(out):
        estimate(*args, num_gpus_per_node=GPUS)
    return [float(g) for g in re.findall(r"\|\s+([\d.]+)GB \|", out.getvalue())]


def test_zero2_model_states_equal_deepspeeds_estimator(counts) -> None:
    total = counts["total"]
    for offload in (False, True):
        _, expected = estimate_zero2_model_states_mem_needs(total, GPUS, cpu_offload=offload)
        assert _states_on_gpu(counts, Zero(2, offload)) == pytest.approx(expected, abs=8), offload
    # what `estimate_zero2_model_states_mem_needs_all_cold` prints: offload_optimizer=cpu, then none
    printed = _printed_gpu_gib(estimate_zero2_model_states_mem_needs_all_cold, total)
    ours = [_states_on_gpu(counts, Zero(2, offload)) / GiB for offload in (True, False)]
    assert printed == pytest.approx(ours, abs=0.006)


def test_zero3_model_states_equal_deepspeeds_estimator(counts) -> None:
    total, largest = counts["total"], counts["largest"]
    layouts = [(True, True), (True, False), (False, False)]  # (offload optimizer, offload weights), as printed
    for optimizer, weights in layouts:
        _, expected, _ = estimate_zero3_model_states_mem_needs(
            total, largest, GPUS, cpu_offload=optimizer, cpu_offload_params=weights
        )
        assert _states_on_gpu(counts, Zero(3, optimizer, weights)) == pytest.approx(expected, abs=8)
    printed = _printed_gpu_gib(estimate_zero3_model_states_mem_needs_all_cold, total, largest)
    ours = [_states_on_gpu(counts, Zero(3, o, w)) / GiB for o, w in layouts for _zero_init in range(2)]
    assert printed == pytest.approx(ours, abs=0.006)


def test_without_deepspeed_full_fine_tuning_keeps_adam_in_the_weights_dtype(counts) -> None:
    """torch AdamW on bf16 weights (DDP): weights, gradients and two moments, 8 bytes per parameter, unsharded."""
    assert _states_on_gpu(counts, Zero()) == 8 * counts["total"]


@pytest.fixture
def launched(monkeypatch) -> Iterator[Callable[..., None]]:
    """Set the environment `accelerate launch <cli>` gives its processes (rank 0 of 8); the DeepSpeed config
    transformers registers on parsing is dropped afterwards so no later test sees a ZeRO-3 launch."""
    from transformers.integrations import deepspeed

    def launch(*cli: str) -> None:
        parsed = launch_command_parser().parse_args([*cli, "--main_process_port", "0", "recipes/train.py"])
        args, defaults, mixed_precision_from_file = _validate_launch_command(parsed)
        fields = [*defaults.deepspeed_config, *(["mixed_precision"] if mixed_precision_from_file else [])]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)  # as `launch_command` sets it
        _, env = prepare_deepspeed_cmd_env(args)
        for key, value in env.items():
            if key.startswith("ACCELERATE_"):
                monkeypatch.setenv(key, value)

    class Rank:  # one of the launch's 8 processes, without starting them
        num_processes, is_main_process = GPUS, True

    monkeypatch.setattr("accelerate.PartialState", Rank)
    monkeypatch.chdir(REPO)
    yield launch
    deepspeed.unset_hf_deepspeed_config()


@pytest.mark.parametrize(
    ("cli", "expected"),
    [
        (("--config_file", "accelerate_configs/zero2.yaml"), Zero(2)),
        (("--config_file", "accelerate_configs/zero3.yaml"), Zero(3)),
        (("--config_file", "accelerate_configs/zero3.yaml", "--offload_optimizer_device", "cpu"), Zero(3, True)),
        (
            ("--config_file", "accelerate_configs/zero3.yaml", "--offload_param_device", "cpu"),
            Zero(3, False, True),
        ),
    ],
)
def test_the_gate_plans_the_zero_layout_accelerate_launched(launched, cli, expected) -> None:
    launched(*cli)
    plan = plan_check.check_before_training(*_recipe("recipes/shapes/qwen2_5_vl_3b_lora.yaml", *FULL_FT))
    assert f"{GPUS} process(es), {expected.describe()}" in plan.sizes
    # and the plan CLI, given the same file and flags as an accelerate config, agrees
    assert plan_build.accelerate_layout(cli[1], None)[1].stage == expected.stage


def test_the_gate_passes_a_zero2_full_fine_tune_that_ddp_cannot_hold(launched, monkeypatch) -> None:
    """On 24 GiB cards: DDP holds 8 bytes per parameter (28 GiB for 3.75 B), ZeRO-2 on 8 GPUs 2 + 18 / 8."""
    _fake_gpu(monkeypatch, 24)
    with pytest.raises(RecipeError, match="24.0 GiB"):
        plan_check.check_before_training(*_recipe("recipes/shapes/qwen2_5_vl_3b_lora.yaml", *FULL_FT))
    launched("--config_file", "accelerate_configs/zero2.yaml")
    assert plan_check.check_before_training(*_recipe("recipes/shapes/qwen2_5_vl_3b_lora.yaml", *FULL_FT)).fits(24 * GiB)


def test_accelerate_config_files_give_their_layout(tmp_path: Path) -> None:
    assert plan_build.accelerate_layout(str(REPO / "accelerate_configs/ddp.yaml"), None) == (8, Zero())
    assert plan_build.accelerate_layout(str(REPO / "accelerate_configs/zero2.yaml"), 4) == (4, Zero(2))
    offloaded = tmp_path / "offload.yaml"
    offloaded.write_text(
        "distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  zero_stage: 3\n"
        "  offload_optimizer_device: cpu\n  offload_param_device: nvme\n"
    )
    assert plan_build.accelerate_layout(str(offloaded), None) == (8, Zero(3, True, True))
    json_file = tmp_path / "ds.json"
    json_file.write_text('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}')
    pointing = tmp_path / "file.yaml"
    pointing.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {json_file}\n")
    assert plan_build.accelerate_layout(str(pointing), None) == (1, Zero(2, True))
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: zero_stage must be 0, 1, 2 or 3, got 4"):
        plan_build.accelerate_layout(str(bad), None)
