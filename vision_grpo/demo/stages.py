"""The demo's stages: a training entry point run as a child process (reused when its run already finished), the
models of an experiment trained in turn (warm start, GRPO from it, the SFT control) and evaluated in this process
(greedy on real, blank and shuffled images, pass@k), each stage announced and timed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vision_grpo.demo.experiments import (
    CURVE_POINTS,
    EVAL_BATCH,
    PASS_K,
    QUICK_EVAL,
    QUICK_GRPO,
    QUICK_SFT,
    REPO,
    VARIANT_POINTS,
    Experiment,
)
from vision_grpo.evaluation.evaluate import main as evaluate_main
from vision_grpo.evaluation.pass_at_k import main as pass_at_k_main

# The training stages running now: stopped (SIGTERM: each saves a checkpoint and ends) if the demo fails elsewhere.
RUNNING: set[subprocess.Popen] = set()


@dataclass
class Evaluated:
    """One model's results: greedy on real, blank and shuffled (another image's) images, k samples per image, and how
    long it trained."""

    label: str
    greedy: dict[str, Any]
    blank: dict[str, Any]
    shuffled: dict[str, Any]
    sampled: dict[str, Any]
    training: str  # what trained it after the warm start, e.g. "120 steps, 87 s"


class StageClock:
    """Announces each stage and keeps its wall time, so the report says where the demo's minutes go. Stages of the
    two experiments may overlap (`--jobs 2`): each is timed from its own start to its own end."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        yield
        self.stages.append((name, time.perf_counter() - start))
        print(f"=== done in {self.stages[-1][1]:.0f} s: {name} ===", flush=True)

    def table(self) -> str:
        rows = [f"| {name} | {seconds:.0f} |" for name, seconds in self.stages]
        return "\n".join(["| stage | wall seconds |", "|---|---|", *rows])


def run_stage(
    script: str, recipe: str, runs_dir: Path, run_name: str, extra: list[str], fresh: bool, log: Path | None
) -> Path:
    """Run a training entry point unless its run folder already finished; return the run folder.

    An unfinished (or, with `fresh`, any) earlier run in the folder is replaced (`--overwrite_run`), not mixed with.
    With `log`, the stage's output goes to that file (two stages running side by side would interleave their
    progress bars on the terminal); a failure prints its end.
    """
    output_dir = runs_dir / Path(recipe).parent.name / Path(recipe).stem
    run_dir = output_dir / run_name
    manifest = run_dir / "manifest.json"
    if not fresh and manifest.exists() and json.loads(manifest.read_text()).get("ended"):
        print(f"reusing {run_dir} (finished earlier; --fresh to redo)", flush=True)
        return run_dir
    command = [sys.executable, script, "--config", recipe, "--output_dir", str(output_dir), "--run_name", run_name]
    command += ["--overwrite_run", "true", *extra]
    print(" ".join(command[1:]) + (f"\n  (its output: {log})" if log else ""), flush=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as files:
        out = files.enter_context(log.open("w", encoding="utf-8")) if log else None
        with subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT if out else None) as process:
            RUNNING.add(process)
            try:
                returncode = process.wait()
            finally:
                RUNNING.discard(process)
    if returncode != 0:
        tail = f"; the end of {log}:\n{log.read_text(encoding='utf-8', errors='replace')[-4000:]}" if log else ""
        raise SystemExit(f"{script} --config {recipe} failed ({returncode}){tail}")
    return run_dir


def run_scalars(run_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return events


# Model passes over each token: GRPO's generation forward, then its training forward and backward (counted as two
# passes); SFT's forward and backward. The control's compute is matched in these token-passes, not in seconds.
GRPO_PASSES, SFT_PASSES = 4, 3


def tokens_at(run_dir: Path, step: int) -> int:
    """The tokens TRL counted (`num_tokens`: prompt and completion tokens without padding, every sequence) up to
    `step`: its last logged value at or before that step, scaled to the step (exact where the step was logged)."""
    logged = [p for p in run_scalars(run_dir).Scalars("train/num_tokens") if p.step <= step]
    if not logged:
        raise SystemExit(f"{run_dir}: no train/num_tokens logged at or before step {step}; log more often")
    return round(logged[-1].value * step / logged[-1].step)


# GRPO's training forward and backward (two passes) over each token position the training pass computed.
TRAINING_PASSES = 3


def measured_passes(run_dir: Path, step: int) -> int:
    """GRPO's token-passes up to `step`, as measured: every generated token once (TRL's `num_tokens`, every round's
    sequences included) and every token position of the training pass three times (the logged
    `training_pass/positions_computed`: a step's mean over each logging window, times the window's steps). Rows left
    out of the training pass cost nothing here, where `GRPO_PASSES` x tokens counts every generated token trained."""
    logged = [p for p in run_scalars(run_dir).Scalars("train/training_pass/positions_computed") if p.step <= step]
    if not logged or logged[-1].step != step:
        raise SystemExit(f"{run_dir}: no train/training_pass/positions_computed logged at step {step}; --fresh")
    windows = zip([0] + [p.step for p in logged[:-1]], logged, strict=True)
    positions = sum(point.value * (point.step - before) for before, point in windows)
    return tokens_at(run_dir, step) + round(TRAINING_PASSES * positions)


def trained(run_dir: Path) -> tuple[int, int]:
    """(steps, tokens) of a finished run: the manifest's last step and the tokens TRL counted up to it."""
    steps = json.loads((run_dir / "manifest.json").read_text())["global_step"]
    return steps, tokens_at(run_dir, steps)


def curve_checkpoints(steps: int, points: int = CURVE_POINTS) -> list[str]:
    """Training options that save about `points` checkpoints over `steps` (kept, for the compute curve)."""
    every = max(1, math.ceil(steps / points))
    return ["--save_strategy", "steps", "--save_steps", str(every), "--save_total_limit", str(points + 1)]


def control_steps(warm_run: Path, grpo_run: Path) -> int:
    """SFT steps that make as many token-passes as the GRPO stage, at the warm start's tokens per step.

    Counted in model passes over tokens rather than seconds, so the control is the same run on every machine (the
    GRPO stage's tokens follow its sampled completions, fixed by the seed); a step count, so the control is an
    ordinary recipe run whose length is written in its manifest.
    """
    warm_steps, warm_tokens = trained(warm_run)
    _, grpo_tokens = trained(grpo_run)
    return max(1, round(GRPO_PASSES * grpo_tokens / (SFT_PASSES * warm_tokens / warm_steps)))


def evaluate(model: Path, recipe: str, name: str, results_dir: Path, extra: list[str], control: str) -> dict:
    """Greedy evaluation of `model` on the GRPO recipe's held-out images (same prompts and pixels as training).

    Always redone (seconds, `--overwrite`): a result file must belong to the models the stages above produced.
    """
    argv = ["--config", recipe, "--model_name_or_path", str(model), "--output", str(results_dir / f"{name}.json")]
    return evaluate_main([*argv, "--batch_size", str(EVAL_BATCH), "--image_control", control, "--overwrite", *extra])


def sample(model: Path, recipe: str, name: str, results_dir: Path, extra: list[str]) -> dict:
    """pass@k of `model` on the same images: k samples each, at the GRPO recipe's training temperature."""
    output = results_dir / f"{name}_pass{PASS_K}.json"
    argv = ["--config", recipe, "--model_name_or_path", str(model), "--output", str(output)]
    return pass_at_k_main([*argv, "--batch_size", str(EVAL_BATCH), "--k", str(PASS_K), *extra])


def evaluate_all(
    model: Path, recipe: str, name: str, label: str, results_dir: Path, extra: list[str], training: str
) -> Evaluated:
    greedy, blank, shuffled = (
        evaluate(model, recipe, name + suffix, results_dir, extra, control)
        for suffix, control in (("", "none"), ("_blank", "blank"), ("_shuffled", "shuffled"))
    )
    return Evaluated(label, greedy, blank, shuffled, sample(model, recipe, name, results_dir, extra), training)


def _trained_for(run_dir: Path, passes: int | None) -> str:
    """Steps and token-passes: `passes` per generated token, or (None) as measured (`measured_passes`)."""
    steps, tokens = trained(run_dir)
    total = measured_passes(run_dir, steps) if passes is None else passes * tokens
    return f"{steps} steps, {total / 1e6:.2f} M token-passes"


Runs = list[tuple[Path, str, str, str]]  # (run folder, result name, column label, training) of each model
Trained = tuple[Path, Runs]  # the GRPO run, and every model of the experiment


def train_experiment(experiment: Experiment, args: argparse.Namespace, runs_dir: Path, clock: StageClock) -> Trained:
    """Train the experiment's models, reusing finished runs: warm start, GRPO from it (and the SFT control)."""
    run_name = args.run_name + experiment.run_suffix
    seed = [] if experiment.seed is None else ["--seed", str(experiment.seed)]
    sft_flags, grpo_flags = ([*QUICK_SFT, *seed], [*QUICK_GRPO, *seed]) if args.quick else (seed, seed)  # every stage
    logs = Path(args.results_dir).resolve() / "logs"

    def log(stage: str) -> Path | None:  # stages side by side write to files, one at a time to the terminal
        return logs / f"{run_name}-{stage}.log" if args.jobs > 1 else None

    with clock.stage(f"{experiment.title}: supervised warm start (TRL SFTTrainer)"):
        warm_run = run_stage(
            "recipes/sft.py", experiment.sft_recipe, runs_dir, run_name, sft_flags, args.fresh, log("sft")
        )
    with clock.stage(f"{experiment.title}: GRPO (TRL GRPOTrainer)"):
        grpo_extra = ["--model_name_or_path", str(warm_run), *grpo_flags]
        grpo_run = run_stage(
            "recipes/train.py", experiment.grpo_recipe, runs_dir, run_name, grpo_extra, args.fresh, log("grpo")
        )
    measured = experiment.variant is not None  # two GRPO arms: their token-passes as measured
    runs = [
        (warm_run, "warm_start", "warm start", "–"),
        (grpo_run, "grpo", "after GRPO", _trained_for(grpo_run, None if measured else GRPO_PASSES)),
    ]
    if experiment.variant is not None:
        label, flags = experiment.variant
        with clock.stage(f"{experiment.title}: {label}, from the same warm start"):
            recipe = yaml.safe_load((REPO / experiment.grpo_recipe).read_text())
            steps = int(grpo_flags[grpo_flags.index("--max_steps") + 1]) if args.quick else recipe["max_steps"]
            variant_extra = [*grpo_extra, *flags, *curve_checkpoints(steps, VARIANT_POINTS)]
            variant_run = run_stage(
                "recipes/train.py",
                experiment.grpo_recipe,
                runs_dir,
                f"{run_name}-{experiment.key}",
                variant_extra,
                args.fresh,
                log(experiment.key),
            )
        runs.append((variant_run, "grpo_variant", label, _trained_for(variant_run, None)))
    if experiment.sft_control:
        with clock.stage(
            f"{experiment.title}: control, more SFT on the same demonstrations for the GRPO stage's compute"
        ):
            steps = control_steps(warm_run, grpo_run)
            control_extra = ["--model_name_or_path", str(warm_run), *sft_flags, "--max_steps", str(steps)]
            if experiment.compute_curve:  # checkpoints along the way, each step's tokens logged (demo/curve.py)
                control_extra += ["--logging_steps", "1", *curve_checkpoints(steps)]
            control_run = run_stage(
                "recipes/sft.py",
                experiment.sft_recipe,
                runs_dir,
                f"{run_name}-control",
                control_extra,
                args.fresh,
                log("control"),
            )
        runs.append((control_run, "sft_control", "SFT control (more SFT)", _trained_for(control_run, SFT_PASSES)))
    return grpo_run, runs


def evaluate_experiment(
    experiment: Experiment, runs: Runs, args: argparse.Namespace, clock: StageClock
) -> list[Evaluated]:
    """Every model of the experiment on the held-out images, in this process (one evaluation at a time)."""
    results_dir = Path(args.results_dir).resolve()
    eval_extra = QUICK_EVAL if args.quick else []
    with clock.stage(f"{experiment.title}: held-out evaluation (greedy real, blank and shuffled, pass@{PASS_K})"):
        return [
            evaluate_all(
                run, experiment.grpo_recipe, experiment.results_prefix + name, label, results_dir, eval_extra, training
            )
            for run, name, label, training in runs
        ]
