"""Where a training step's time goes, ours against bare TRL: both runs under cProfile, seconds per step by part.

    python benchmarks/step_profile.py [--steps 8] [--quick]

The usual suspects of a slow wrapper, each the cumulative time of the function that does it (the parts overlap:
they are not meant to add up):
- TRL's `training_step` (generation, rewards, loss, backward) and, inside it, generation, the processor (images to
  pixel values and prompts to tokens: done by TRL at every step on both sides), and the reward functions;
- data loading (the data loader decoding stored rows), logging (metrics and TensorBoard), trainer callbacks;
- our per-step hooks: the reward plugins' checking wrapper (reward included), our callbacks, our sampler.
On a loaded machine the absolute seconds move, but both sides move alike, and a part that ours spends and bare TRL
does not shows as a difference far above the noise. cProfile slows Python code, so these are not s/step figures.
"""

from __future__ import annotations

import argparse
import pstats
import tempfile
from collections.abc import Callable
from pathlib import Path

from common import RECIPE, REPO, check, machine, markdown_table, report, run_measured
from train_overhead import SIDES

Key = tuple[str, int, str]  # pstats' (file, line, function)
OUR_FOLDERS = tuple(str(REPO / folder) + "/" for folder in ("vision_grpo", "data", "rewards", "eval", "recipes"))
# What our entry point adds to every step: the reward plugins' checking wrapper (it calls the reward itself, which
# bare TRL calls directly), our trainer callbacks, and the sampler's per-epoch reseeding.
OUR_HOOKS = {"checked", "on_step_begin", "on_step_end", "on_log", "on_train_begin", "on_train_end", "set_epoch"}


def _function(path_end: str, name: str) -> Callable[[Key], bool]:
    return lambda key: key[0].endswith(path_end) and key[2] == name


TRAINING_STEP = "TRL training_step (all of a step's work)"
PARTS: dict[str, Callable[[Key], bool]] = {
    TRAINING_STEP: _function("trl/trainer/grpo_trainer.py", "training_step"),
    "  generation": _function("trl/trainer/grpo_trainer.py", "_generate"),
    "  image processor (images -> pixel values)": _function("qwen2_vl/image_processing_pil_qwen2_vl.py", "_preprocess"),
    "  reward functions": _function("trl/trainer/grpo_trainer.py", "_calculate_rewards"),
    "data loading (stored rows decoded)": _function("torch/utils/data/dataloader.py", "__next__"),
    "logging (metrics, TensorBoard)": _function("transformers/trainer.py", "_maybe_log_save_evaluate"),
    "trainer callbacks": _function("transformers/trainer_callback.py", "call_event"),
}


def profile(side: str, workdir: Path, steps: int) -> dict[str, float]:
    """Seconds per step of each part for one profiled run of `side`."""
    output, profile_path = workdir / side, workdir / f"{side}.prof"
    overrides = ["--output_dir", str(output), "--run_name", "bench", "--max_steps", str(steps)]
    overrides += ["--save_strategy", "no", "--logging_steps", "1", "--report_to", "tensorboard"]
    script = [*SIDES[side], "--config", str(RECIPE), *overrides]
    check(run_measured(["-m", "cProfile", "-o", str(profile_path), *script]), f"{side} under cProfile")
    stats = pstats.Stats(str(profile_path)).stats  # type: ignore[attr-defined]
    parts = {name: sum(v[3] for k, v in stats.items() if match(k)) / steps for name, match in PARTS.items()}
    if not parts[TRAINING_STEP]:
        raise RuntimeError(f"{side}: no time in TRL's training_step; has TRL renamed it? (see PARTS)")
    hooks = sum(v[3] for k, v in stats.items() if k[0].startswith(OUR_FOLDERS) and k[2] in OUR_HOOKS)
    parts["our per-step hooks (reward checks, callbacks, sampler)"] = hooks / steps
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per profiled run")
    parser.add_argument("--quick", action="store_true", help="smallest setting: 2 steps")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    steps = 2 if args.quick else args.steps

    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        ours, bare = profile("ours", Path(tmp), steps), profile("bare", Path(tmp), steps)
    rows = [[name, ours[name], bare[name], ours[name] - bare[name]] for name in ours]
    print(f"\nWhere a step's time goes (cProfile, {steps} steps incl. the first, s per step; {machine()})")
    print(markdown_table(["part", "ours", "bare TRL", "ours - bare"], rows))
    report("step_profile", {"steps": steps, "ours": ours, "bare": bare, "machine": machine()}, args.json)


if __name__ == "__main__":
    main()
