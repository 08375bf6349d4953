"""What trains: the vision tower's three modes (`vision_tower: train | freeze | scaled_lr`), where LoRA adapters go,
and that LoRA under gradient checkpointing really learns.

The training tests run the real entry point for 2 steps on the tiny model with a reward that varies between
completions (tests/recording), and compare bit-level checksums of the weights before and after.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FAMILY_MODELS, run_script
from peft import get_peft_model
from recording.recorder import RECORD_ENV, read_records, recorded_training_args
from trl import ModelConfig

from vision_grpo.models.embedded import TINY_MODEL
from vision_grpo.models.loading import load_model
from vision_grpo.models.lora import get_peft_config
from vision_grpo.models.vision import freeze_vision_tower, is_vision_parameter
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.training.trainer import split_vision_param_group


def tiny_model(**model_args) -> torch.nn.Module:
    return load_model(ModelConfig(model_name_or_path=TINY_MODEL, dtype="float32", **model_args))


def train_recorded(tmp_path: Path, *overrides: str) -> tuple[dict, dict, list[dict]]:
    """2 recorded steps of the tiny recipe; returns (the start record, checksums after the last step, step records)."""
    records = tmp_path / "records"
    records.mkdir()
    run_script(
        recorded_training_args(tmp_path / "runs" / "run", *overrides), timeout=600, env={RECORD_ENV: str(records)}
    )
    (begin,) = read_records(records, "begin")
    steps = read_records(records, "step")
    assert [step["step"] for step in steps] == [1, 2]
    return begin, steps[-1]["checksums"], steps


@pytest.mark.parametrize("lora_on_vision", [False, True])
def test_lora_stays_off_the_vision_tower_unless_asked(lora_on_vision: bool) -> None:
    model_args = {"use_peft": True, "lora_r": 4}
    config = get_peft_config(ModelConfig(**model_args), TaskArguments(lora_on_vision=lora_on_vision))
    adapters = [
        name for name, _ in get_peft_model(tiny_model(**model_args), config).named_parameters() if "lora_" in name
    ]
    on_vision = [name for name in adapters if is_vision_parameter(name)]
    assert len(adapters) > len(on_vision)  # the language model always gets adapters
    assert bool(on_vision) is lora_on_vision


def test_scaled_vision_groups_hold_exactly_the_vision_parameters_and_split_once() -> None:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):  # the Trainer may ask twice for one optimizer (DeepSpeed does)
        split_vision_param_group(optimizer, model, 0.1)
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    vision_groups = [group for group in optimizer.param_groups if group.get("vision_tower")]
    assert vision_groups and all(group["lr"] == pytest.approx(1e-4) for group in vision_groups)
    in_vision_groups = {names[id(p)] for group in vision_groups for p in group["params"]}
    assert in_vision_groups == {name for name in names.values() if is_vision_parameter(name)}
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(names)  # nothing lost or doubled


def test_scaled_lr_without_a_trainable_vision_tower_fails_clearly() -> None:
    model = tiny_model()
    freeze_vision_tower(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(ValueError, match="no trainable vision-tower parameters"):
        split_vision_param_group(optimizer, model, 0.1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("replica", "mode", "vision_moves"),
    [*((replica, "freeze", False) for replica in FAMILY_MODELS), (TINY_MODEL, "train", True)],
)
def test_vision_tower_mode_decides_whether_its_weights_change(
    tmp_path: Path, replica: str, mode: str, vision_moves: bool
) -> None:
    """Full fine-tuning, so that only `vision_tower` decides: frozen weights stay bit-identical."""
    overrides = ["--model_name_or_path", replica, "--use_peft", "false", "--vision_tower", mode]
    begin, end, _steps = train_recorded(tmp_path, *overrides)
    begin = begin["checksums"]
    assert end["language"] != begin["language"], "the language model did not train, so the check proves nothing"
    assert (end["vision"] != begin["vision"]) is vision_moves


@pytest.mark.slow
@pytest.mark.parametrize("replica", FAMILY_MODELS)
def test_scaled_lr_gives_the_vision_groups_the_scaled_rate_at_every_step(tmp_path: Path, replica: str) -> None:
    """The GPU recipe's set-up: LoRA on the language model and the vision tower, the vision adapters at 0.1x."""
    overrides = ["--model_name_or_path", replica, "--lora_on_vision", "true", "--vision_tower", "scaled_lr"]
    overrides += ["--vision_lr_scale", "0.1"]
    begin, end, steps = train_recorded(tmp_path, *overrides)
    trainable_vision = {name for name in begin["trainable"] if is_vision_parameter(name)}
    begin = begin["checksums"]
    assert trainable_vision and all("lora_" in name for name in trainable_vision)
    for step in steps:
        groups = step["param_groups"]
        vision = [group for group in groups if group["vision_tower"]]
        others = [group for group in groups if not group["vision_tower"] and group["names"]]
        assert {name for group in vision for name in group["names"]} == trainable_vision
        assert all(group["lr"] == pytest.approx(0.1 * others[0]["lr"]) for group in vision)
        assert len({group["lr"] for group in others}) == 1
    assert end["lora"] != begin["lora"]
    assert end["vision"] == begin["vision"], "LoRA must leave the vision tower's own weights untouched"


@pytest.mark.slow
def test_lora_with_activation_checkpointing_learns(tmp_path: Path) -> None:
    """The classic pitfall: checkpointed layers whose inputs do not require grad give the adapters no gradient
    ("element 0 of tensors does not require grad", or silently nothing)."""
    begin, end, steps = train_recorded(tmp_path, "--activation_checkpointing", "true", "--use_peft", "true")
    begin = begin["checksums"]
    assert all(step["activation_checkpointing"] for step in steps), "checkpointing was not on while training"
    assert end["lora"] != begin["lora"], "the LoRA weights did not change"
    assert (end["language"], end["vision"]) == (begin["language"], begin["vision"]), "LoRA changed base weights"
    logs = [entry["logs"] for entry in read_records(tmp_path / "records", "log")]
    grad_norms = [entry["grad_norm"] for entry in logs if "grad_norm" in entry]
    assert len(grad_norms) == 2 and all(norm > 0 for norm in grad_norms)
