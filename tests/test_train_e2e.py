"""A real GRPO run of the tiny model through the entry point a user runs, checked from what it leaves on disk.

A random-weight model earns no counting reward, so no gradient would flow; a test-only plugin folder adds a shaping
reward (longer completions score more) that always varies within a group, so the LoRA weights must move.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_script
from peft import PeftModel
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trl import ModelConfig

from vision_grpo.models.embedded import TINY_MODEL
from vision_grpo.models.loading import load_model

CPU_LAUNCH_CONFIG = REPO / "accelerate_configs" / "cpu.yaml"
SHAPING_PLUGIN = '''
from vision_grpo.rewards import completion_texts, reward


@reward()
def e2e_length_shaping(completions, **kwargs):
    """Test only: characters / 10, so completions of one prompt (almost) never tie."""
    return [len(text) / 10 for text in completion_texts(completions)]
'''
REWARDS = ["count_correct", "count_description", "count_reasoning", "e2e_length_shaping"]


@pytest.mark.slow
def test_grpo_run_logs_every_reward_and_trains_the_adapter(tiny_model_path: Path, tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "e2e_shaping.py").write_text(SHAPING_PLUGIN)
    # accelerate's CPU config starts two processes (gloo); without it, the script runs as one plain process.
    launcher = ["-m", "accelerate.commands.launch", "--config_file", str(CPU_LAUNCH_CONFIG)]
    recipe_args = ["recipes/train.py", "--config", "recipes/shapes/tiny_cpu.yaml"]
    overrides = {
        "--output_dir": str(tmp_path / "runs"),
        "--run_name": "e2e",
        "--max_steps": "2",
        "--shapes_train_size": "8",
        "--per_device_train_batch_size": "4",
        "--num_generations": "4",
        "--max_completion_length": "8",
        "--save_strategy": "no",
        "--token_check_samples": "4",
        "--reward_dirs": str(plugins),
    }
    lists = ["--reward_funcs", *REWARDS, "--reward_weights", "1", "0.5", "0.2", "1"]
    args = [*recipe_args, *(item for pair in overrides.items() for item in pair), *lists]
    run_script([*launcher, *args] if CPU_LAUNCH_CONFIG.exists() else args, timeout=300)

    run_dir = tmp_path / "runs" / "e2e"
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert recipe["reward_funcs"] == REWARDS and recipe["max_steps"] == 2
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["ended"] is not None and manifest["global_step"] == 2

    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for name in REWARDS:
        assert f"train/rewards/{name}/mean" in scalars
    assert [e.step for e in events.Scalars("train/rewards/e2e_length_shaping/mean")] == [1, 2]

    adapter = load_file(str(run_dir / "adapter_model.safetensors"))
    lora_b = {key: value for key, value in adapter.items() if "lora_B" in key}
    assert lora_b, "no LoRA B matrices saved"
    assert all(value.abs().max() > 0 for value in lora_b.values()), "a LoRA B matrix is still at its zero init"
    assert not any("visual" in key for key in adapter), "the frozen vision tower got adapters"

    base = load_model(ModelConfig(model_name_or_path=TINY_MODEL, dtype="float32"))
    loaded = PeftModel.from_pretrained(base, str(run_dir)).state_dict()
    for key, value in lora_b.items():
        assert torch.equal(loaded[key.replace("lora_B.weight", "lora_B.default.weight")], value)
