"""`make demo`: two GRPO experiments on the embedded default, offline on a CPU (docs/demo.md says how long);
`make experiment-perception` runs the third (`--experiments perception`).

1. Format: a supervised warm start on a mix of answer forms (recipes/shapes/tiny_sft.yaml) -> GRPO. The warm start can
   count but mostly does not finish with the boxed answer the reward requires; GRPO teaches the format.
2. Biased demonstrations: a warm start on demonstrations that say 2 for most 3-shape images
   (recipes/shapes/tiny_sft_biased.yaml) -> GRPO, and as the control the same warm start trained further with SFT on
   the same demonstrations for as long as the GRPO stage trained. Greedy imitation follows the majority label; the
   question is whether reward recovers what the samples still know and more imitation does not.
3. Perception: counting 1-5 shapes of random sizes from a warm start whose errors are miscounts
   (recipes/shapes/tiny_sft_perception.yaml), GRPO against the SFT control at equal token-passes, with the held-out
   accuracy of both arms' checkpoints against compute (demo/curve.py).

Every model is evaluated greedily on the same held-out images, real, blank and shuffled (eval/evaluate.py), and by
pass@k at the training temperature (eval/pass_at_k.py); a table per experiment with McNemar's tests and the honesty
checks, and one PNG with every experiment run. Each experiment's section is kept in <results dir>/sections/, so
report.md holds every experiment run into that folder, by either command. Every stage runs the repository's own
entry points with the recipes in recipes/shapes/, so the demo exercises exactly what users run. A finished stage is
reused when the demo is run again (`--fresh` redoes everything).

The experiments share nothing until the report, so with two cores their training stages run side by side
(`--jobs`), each in a process of its own with the same single-threaded, seeded computation as when run one after the
other; the first experiment is evaluated while the second still trains.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vision_grpo.demo.curve import compute_curve, curve_table, equal_compute_test, plot_curve
from vision_grpo.demo.experiments import DEMO_EXPERIMENTS, EXPERIMENTS, QUICK_EVAL, Experiment
from vision_grpo.demo.generalization import generalization_section
from vision_grpo.demo.plot import plot
from vision_grpo.demo.report import report
from vision_grpo.demo.stages import (
    RUNNING,
    Evaluated,
    Runs,
    StageClock,
    Trained,
    evaluate_experiment,
    train_experiment,
)
from vision_grpo.models.embedded import TINY_MODEL, resolve_model_path
from vision_grpo.run.threads import default_threads, usable_cores


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m vision_grpo.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", default="runs", help="where the training runs go (TensorBoard: --logdir here)")
    parser.add_argument("--results-dir", default="results/demo", help="where the result files, tables and PNG go")
    parser.add_argument("--run-name", default="demo")
    parser.add_argument("--quick", action="store_true", help="toy-sized run of every stage (for tests)")
    parser.add_argument("--fresh", action="store_true", help="redo every stage instead of reusing finished ones")
    parser.add_argument(
        "--experiments",
        nargs="+",
        default=list(DEMO_EXPERIMENTS),
        choices=[e.key for e in EXPERIMENTS],
        help=f"which experiments to run (default: {' '.join(DEMO_EXPERIMENTS)})",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        choices=range(1, len(EXPERIMENTS) + 1),
        help="experiments trained side by side (default: one per core and experiment); 1 runs every stage in turn, "
        "its output on the terminal",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="train every stage with this seed instead of the recipes' (runs, results and report section named by "
        "it; the held-out images stay the same); `python -m vision_grpo.demo.seeds` then tables the spread",
    )
    args = parser.parse_args(argv)
    chosen = [e for e in EXPERIMENTS if e.key in args.experiments]
    if args.seed is not None:
        chosen = [e.seeded(args.seed) for e in chosen]
    args.jobs = min(args.jobs or usable_cores(), len(chosen))
    if len({e.run_suffix for e in chosen}) < len(chosen):  # experiments sharing runs: one trains them, the next reuses
        args.jobs = 1
    start = time.perf_counter()
    runs_dir, results_dir = Path(args.runs_dir).resolve(), Path(args.results_dir).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    # Stages side by side share the cores: without a choice of the user's, each gets its share (1 on 2 cores).
    os.environ.setdefault("OMP_NUM_THREADS", str(default_threads(args.jobs)))

    clock = StageClock()
    with clock.stage("embedded tiny VLM"):
        print(resolve_model_path(TINY_MODEL))
    results, facts = [], {}
    sections = results_dir / "sections"
    sections.mkdir(exist_ok=True)
    with ThreadPoolExecutor(max_workers=len(chosen)) as pool:
        if args.jobs > 1:  # every experiment's training starts now; each is evaluated as soon as it is trained
            futures = [pool.submit(train_experiment, e, args, runs_dir, clock) for e in chosen]
            trained: Iterator[Trained] = (future.result() for future in futures)
        else:  # one stage at a time: each experiment trains after the one before was evaluated
            trained = (train_experiment(e, args, runs_dir, clock) for e in chosen)
        try:
            for experiment, (grpo_run, runs) in zip(chosen, trained, strict=True):
                if experiment.held_out_variants:  # its own held-out sets, table and PNGs
                    section = generalization_section(experiment, runs, results_dir, args.quick, clock)
                    table, facts[experiment.title] = section
                else:
                    models = evaluate_experiment(experiment, runs, args, clock)
                    table, facts[experiment.title] = report(experiment, models)
                    if experiment.compute_curve:
                        table += "\n\n" + _curve(experiment, runs, models, args, results_dir, clock)
                    results.append((experiment, grpo_run, models))
                (sections / f"{experiment.section}.md").write_text(table + "\n", encoding="utf-8")
        # A failed stage (run_stage raises SystemExit) or evaluation; Ctrl-C has reached the stages already (one
        # process group), so KeyboardInterrupt is left out.
        except (Exception, SystemExit):
            for process in list(RUNNING):
                process.terminate()
            raise

    names = [e.key for e in chosen if not e.held_out_variants]  # Experiment 5 draws its own PNGs
    stem = "demo" if names == list(DEMO_EXPERIMENTS) else "-".join(names)
    if args.seed is not None:  # seeds write into one results folder side by side (`make experiment-seeds`)
        stem = f"seed{args.seed}_{stem}"
    png = results_dir / f"{stem}.png" if names else None
    if png is not None:
        with clock.stage("report"):
            plot(results, png)
    wall = time.perf_counter() - start
    peak_gib = (
        max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 2**20
    )
    footer = (
        f"wall time {wall / 60:.1f} min (stages reused are not re-timed; {args.jobs} experiment(s) trained side by "
        f"side); peak RSS of any process {peak_gib:.2f} GiB"
    )
    text = write_report(results_dir, [clock.table(), footer])
    print(text)
    print(f"figure: {png}\nresult files: {results_dir}\nTensorBoard: tensorboard --logdir {runs_dir}")
    return {"experiments": facts, "wall_seconds": wall, "peak_rss_gib": peak_gib, "png": png and str(png)}


def write_report(results_dir: Path, after: list[str]) -> str:
    """`report.md`: every experiment's section in this folder, in EXPERIMENTS order (this command's and those an
    earlier one wrote; an experiment's seeds and their spread after it), then `after`."""
    sections = results_dir / "sections"
    files = [
        path
        for e in EXPERIMENTS
        for path in (sections / f"{e.key}.md", *sorted(sections.glob(f"{e.key}-seed*.md")))
        if path.exists()
    ]
    text = "\n\n".join([*(path.read_text(encoding="utf-8").rstrip() for path in files), *after]) + "\n"
    (results_dir / "report.md").write_text(text, encoding="utf-8")
    return text


def _curve(
    experiment: Experiment,
    runs: Runs,
    models: list[Evaluated],
    args: argparse.Namespace,
    results: Path,
    clock: StageClock,
) -> str:
    """The compute curve's evaluations, PNG and the report's table of it."""
    with clock.stage(f"{experiment.title}: held-out accuracy of every checkpoint against compute"):
        curves, records = compute_curve(experiment, runs, models, results, QUICK_EVAL if args.quick else [])
        png = results / f"{experiment.results_prefix}curve.png"
        plot_curve(experiment, curves, models[0].greedy["summary"]["n"], png)
    caption = f"Held-out strict accuracy against compute, both arms from the warm start ({png.name}):"
    test = f"\n\n{equal_compute_test(curves, records)}" if experiment.variant is not None else ""
    return f"{caption}\n\n{curve_table(curves)}{test}"
