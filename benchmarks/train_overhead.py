"""Training overhead and start-up: our entry point against bare TRL, interleaved runs, medians and ratios.

    python benchmarks/train_overhead.py [--pairs 4] [--steps 12] [--quick]

A = `recipes/train.py` (ours), B = `benchmarks/bare_trl.py` (TRL's GRPOTrainer wired by hand), both on the tiny
recipe with the same GRPOConfig values and the same rows. Runs alternate in ABBA order (pair 1: A B, pair 2: B A,
...), so a load change on the shared machine hits both sides alike. Per run, from its TensorBoard events:
- s/step: wall seconds between consecutive logged steps (data loading, generation, backward, callbacks, logging),
  median over the steps after warm-up; `step_time` is TRL's own timer (inside `training_step` only);
- CPU s/step: the process's CPU seconds over the same steps, which moves less with the machine's load;
- start-up: seconds from the command to the start of the first step (imports, model, dataset, trainer).
Ratios are ours / bare per pair, then the median over pairs. Both sides get the same environment: on a loaded
machine, `OMP_NUM_THREADS=1` steadies the figures (with more threads a parallel region waits for its slowest
thread, and a whole run of either side could come out 10-100x slower on a busy 2-core machine).

Like for like: each pair must log the same `num_tokens` (prompt + completion tokens) at every step, i.e. generate
the same completions, or the run stops with the first step that differs. A wall-clock ratio below 1 (ours faster
than bare TRL: 0.86 once) came from the machine's load, not from less work: the tokens matched and the CPU seconds
per step did too (0.97). On a shared machine the CPU-time ratio is the figure to trust; the load average at the
start and end is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from common import RECIPE, Measured, check, machine, markdown_table, median, read_step_log, report, run_measured

SIDES = {"ours": ["recipes/train.py"], "bare": ["benchmarks/bare_trl.py"]}
# The overhead of the entry point, on TRL's training pass: the packed pass computes the same update in another float
# summation order, and the round-off changes the next step's samples (benchmarks/training_pass_costs.py measures it).
TRL_TRAINING_PASS = ["--share_prompt_in_training", "false", "--balance_micro_batches", "false"]
TRL_TRAINING_PASS += ["--skip_zero_advantage", "false"]


def run_once(
    side: str,
    workdir: Path,
    steps: int,
    warmup: int,
    extra: list[str],
    threads: int | None = None,
    tokens: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """One training run of `side` (with `threads` torch threads, else the inherited setting); its per-step medians,
    start-up, peak memory. `tokens[side]` receives its per-step token counts."""
    tokens = {} if tokens is None else tokens
    output = workdir / side
    overrides = ["--output_dir", str(output), "--run_name", "bench", "--max_steps", str(steps)]
    overrides += ["--save_strategy", "no", "--logging_steps", "1", "--report_to", "tensorboard", *extra]
    overrides += TRL_TRAINING_PASS if side == "ours" else []
    # TRL's TensorBoard folder comes from this variable only; one inherited from the caller would take the bare
    # side's events elsewhere (ours sets its own)
    env = {"TENSORBOARD_LOGGING_DIR": str(output), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    measured: Measured = check(run_measured([*SIDES[side], "--config", str(RECIPE), *overrides], env=env), side)
    log = read_step_log(output)
    if len(log.wall_times) != steps:
        raise RuntimeError(f"{side}: {len(log.wall_times)} logged steps of {steps}")
    periods = log.step_periods()[warmup:]  # period k is step k+2: step 1 (lazy initialisation) is never in it
    tokens[side] = log.tokens
    walls = log.wall_times[warmup:]
    cpu = [measured.cpu_at(b) - measured.cpu_at(a) for a, b in zip(walls, walls[1:], strict=False)]
    return {
        "s_per_step": median(periods),
        "trl_step_time": median(log.step_times[warmup + 1 :]),
        "cpu_s_per_step": median(cpu),
        "first_step_s": log.step_times[0],
        "startup_s": log.first_step_start() - measured.started,
        "wall_s": measured.wall_s,
        "peak_rss_mib": measured.peak_rss_mib,
    }


def check_same_work(tokens: dict[str, list[float]]) -> None:
    """Fail unless both sides logged the same token counts at every step: otherwise they generated different
    completions and their times compare different work."""
    for step, (ours, bare) in enumerate(zip(tokens["ours"], tokens["bare"], strict=True), start=1):
        if ours != bare:
            raise RuntimeError(
                f"not like for like: at step {step} ours had seen {ours} tokens, bare TRL {bare}; the two sides "
                "generated different completions (a generation setting that only one side applies?)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=4, help="A/B pairs (each: one run of ours, one of bare TRL)")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="step periods left out of the medians")
    parser.add_argument("--quick", action="store_true", help="smallest setting: 1 pair of 4 steps (smoke test)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("extra", nargs="*", help="more `--key value` recipe overrides for both sides, after `--`")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.steps, args.warmup = 1, 4, 1
    if args.steps < args.warmup + 3:
        parser.error("--steps must leave at least two step periods after --warmup")

    runs: dict[str, list[dict[str, float]]] = {"ours": [], "bare": []}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for pair in range(args.pairs):
            order = ("ours", "bare") if pair % 2 == 0 else ("bare", "ours")
            tokens: dict[str, list[float]] = {}
            for side in order:
                result = run_once(side, Path(tmp) / f"{pair}", args.steps, args.warmup, args.extra, tokens=tokens)
                runs[side].append(result)
                print(f"pair {pair + 1}/{args.pairs} {side}: " + ", ".join(f"{k} {v:.3g}" for k, v in result.items()))
            check_same_work(tokens)
    load = f"load average {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"

    keys = list(runs["ours"][0])
    rows = []
    figures: dict[str, Any] = {"pairs": args.pairs, "steps": args.steps, "machine": machine()}
    for key in keys:
        ours, bare = median([r[key] for r in runs["ours"]]), median([r[key] for r in runs["bare"]])
        ratio = median([a[key] / b[key] for a, b in zip(runs["ours"], runs["bare"], strict=True) if b[key] > 0])
        rows.append([key, ours, bare, ratio])
        figures[key] = {"ours": ours, "bare": bare, "ratio": ratio}
    threads = f", OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}" if "OMP_NUM_THREADS" in os.environ else ""
    figures["load"] = load
    setting = f"{args.pairs} interleaved pairs of {args.steps} steps{threads}"
    print(
        f"\nTraining overhead, tiny recipe, {setting} ({machine()}; {load}); "
        "both sides generated the same tokens at every step"
    )
    print(markdown_table(["figure (median)", "ours", "bare TRL", "ours / bare (median of pairs)"], rows))
    cpu, wall = figures["cpu_s_per_step"]["ratio"], figures["s_per_step"]["ratio"]
    verdict = "met" if cpu <= 1.05 else "NOT met"
    print(f"overhead ratio: CPU s/step {cpu:.3f} (target <= 1.05: {verdict}); wall s/step {wall:.3f} (moves with load)")
    report("train_overhead", figures, args.json)


if __name__ == "__main__":
    main()
