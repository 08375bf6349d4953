"""TRL's colocated weight sync, the path a GPU takes, through a real (CPU) vLLM engine: after a GRPO step the engine
scores a fixed prompt, image and completion as the trained policy does, with LoRA on the language model and with
LoRA on the vision tower only (merged by TRL, loaded through `VisionVLLMGeneration.sync_weights`).

The engine runs in float32 here (TRL would start it in bf16, vLLM's `auto` for a float32 checkpoint), so that the
tolerance is float round-off between two implementations of the same model, not bf16 rounding that could hide a step
of LoRA's size (docs/scaling.md gives the bound)."""

from __future__ import annotations

import json

import pytest
from conftest import RECIPE, check, run_python

# Float32 engine vs float32 policy: the same weights in two implementations (vLLM's CPU kernels, transformers' eager
# attention) differ by float round-off, 4.8e-7 at most here; one step of the recipe moves these log-probabilities
# by far more than this (asserted below), so a missing or partial sync cannot pass.
TOLERANCE = 1e-4
PROBE = ["tests_vllm/cpu_launch.py", "--vllm-dtype", "float32", "tests_vllm/sync_probe.py"]
TRAIN = ["recipes/train.py", "--config", RECIPE, "--max_steps", "2", "--save_strategy", "no"]
TRAIN += ["--reward_dirs", "tests_vllm/rewards", "--reward_funcs", "shortness", "--reward_weights", "1.0"]
LORA = {
    "language": [],
    # Only the vision tower's attention (`qkv`, `proj` name no language-model layer): the engine can match the
    # policy after the step only through synced vision weights and fresh (not cached) vision features.
    "vision": ["--lora_on_vision", "true", "--lora_target_modules", "qkv", "proj"],
}


def probe(tmp_path, lora: str, *switches: str) -> list[dict[str, list[float]]]:
    """The probe's records of a 2-step run: before step 1's generation and before step 2's (after step 1's sync)."""
    out = tmp_path / f"{lora}.json"
    run = [*PROBE, str(out), *switches, *TRAIN, *LORA[lora], "--output_dir", str(tmp_path / lora)]
    check(run_python(run))
    records = json.loads(out.read_text())
    assert len(records) == 2, records
    return records


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("lora", sorted(LORA))
def test_after_a_step_the_engine_scores_as_the_trained_policy(replica, tmp_path, lora) -> None:
    before, after = probe(tmp_path, lora)
    assert gap(before["engine"], before["policy"]) < TOLERANCE, before
    assert gap(after["policy"], before["policy"]) > 10 * TOLERANCE, (before, after)  # the step moved the policy
    assert gap(after["engine"], after["policy"]) < TOLERANCE, after


def test_without_the_sync_the_engine_keeps_the_old_scores(replica, tmp_path) -> None:
    """The check above fails when the sync does nothing: the engine still scores with the weights of step 0."""
    before, after = probe(tmp_path, "vision", "--no-sync")
    assert gap(after["engine"], before["engine"]) < TOLERANCE
    assert gap(after["engine"], after["policy"]) > 10 * TOLERANCE, after
