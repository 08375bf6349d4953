"""`make demo`: two GRPO experiments on the embedded default, offline on a CPU (docs/demo.md says how long).

1. Format: a supervised warm start on a mix of answer forms (recipes/shapes/tiny_sft.yaml) -> GRPO. The warm start can
   count but mostly does not finish with the boxed answer the reward requires; GRPO teaches the format.
2. Biased demonstrations: a warm start on demonstrations that say 2 for most 3-shape images
   (recipes/shapes/tiny_sft_biased.yaml) -> GRPO, and as the control the same warm start trained further with SFT on
   the same demonstrations for as long as the GRPO stage trained. Greedy imitation follows the majority label; the
   question is whether reward recovers what the samples still know and more imitation does not.

Every model is evaluated greedily on the same held-out images, real and blank (eval/evaluate.py), and by pass@k at
the training temperature (vision_grpo/pass_at_k.py); a table per experiment with McNemar's tests and the honesty
checks, and one PNG with both. Every stage runs the repository's own entry points with the recipes in
recipes/shapes/, so the demo exercises exactly what users run. A finished stage is reused when the demo is run again
(`--fresh` redoes everything).

The two experiments share nothing until the report, so with two cores their training stages run side by side
(`--jobs`), each in a process of its own with the same single-threaded, seeded computation as when run one after the
other; the first experiment is evaluated while the second still trains.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vision_grpo.eval.compare import mcnemar_exact
from vision_grpo.eval.evaluate import main as evaluate_main
from vision_grpo.modeling import TINY_MODEL, resolve_model_path
from vision_grpo.pass_at_k import main as pass_at_k_main
from vision_grpo.threads import default_threads, usable_cores

REPO = Path(__file__).resolve().parent.parent
GRPO_RECIPE = "recipes/shapes/tiny_grpo_demo.yaml"
PASS_K = 8
EVAL_BATCH = 50
# `--quick`: the same pipeline at toy size, for the end-to-end test (numbers mean nothing there).
QUICK_SFT = ["--max_steps", "6", "--shapes_train_size", "64", "--per_device_train_batch_size", "8"]
QUICK_SFT += ["--warmup_steps", "1"]
QUICK_GRPO = ["--max_steps", "2", "--shapes_train_size", "32", "--per_device_train_batch_size", "16"]
QUICK_EVAL = ["--shapes_eval_size", "24"]
# The training stages running now: stopped (SIGTERM: each saves a checkpoint and ends) if the demo fails elsewhere.
RUNNING: set[subprocess.Popen] = set()
CURVES = {
    "reward": "strict reward (boxed answer right)",
    "rewards/count_correct/mean": "lenient correctness",
    "rewards/count_format/mean": "format rate",
    "completions/clipped_ratio": "cut off at the limit",
}


@dataclass(frozen=True)
class Experiment:
    """A warm start, GRPO from it and, with `sft_control`, the warm start trained further with SFT instead."""

    title: str
    sft_recipe: str
    run_suffix: str  # run folders: runs/shapes/<recipe>/<run name><suffix>
    results_prefix: str  # result files: <results dir>/<prefix><model>.json
    sft_control: bool

    @property
    def focus_count(self) -> int | None:
        """The count the warm start's demonstrations get wrong (its recipe's `sft_mislabel_count`), if any."""
        return yaml.safe_load((REPO / self.sft_recipe).read_text(encoding="utf-8")).get("sft_mislabel_count")


EXPERIMENTS = (
    Experiment("Experiment 1: GRPO teaches the answer format", "recipes/shapes/tiny_sft.yaml", "", "", False),
    Experiment(
        "Experiment 2: GRPO corrects biased demonstrations",
        "recipes/shapes/tiny_sft_biased.yaml",
        "-biased",
        "biased_",
        True,
    ),
)


@dataclass
class Evaluated:
    """One model's results: greedy on real and on blank images, k samples per image, and how long it trained."""

    label: str
    greedy: dict[str, Any]
    blank: dict[str, Any]
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


def _scalars(run_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return events


def train_seconds(run_dir: Path) -> tuple[int, float]:
    """(steps, seconds) of a finished run's training loop: the manifest's last step, the Trainer's `train_runtime`."""
    steps = json.loads((run_dir / "manifest.json").read_text())["global_step"]
    return steps, _scalars(run_dir).Scalars("train/train_runtime")[-1].value


def control_steps(warm_run: Path, grpo_run: Path) -> int:
    """SFT steps that take as long as the GRPO stage's training loop, at the warm start's measured time per step.

    A step count rather than a time-based stop, so the control run is an ordinary, reproducible recipe run whose
    length is written in its manifest; both measured times stand in the table, so the match can be checked.
    """
    warm_steps, warm_seconds = train_seconds(warm_run)
    return max(1, round(train_seconds(grpo_run)[1] / (warm_seconds / warm_steps)))


def evaluate(model: Path, name: str, results_dir: Path, extra: list[str], control: str) -> dict:
    """Greedy evaluation of `model` on the GRPO recipe's held-out images (same prompts and pixels as training).

    Always redone (seconds, `--overwrite`): a result file must belong to the models the stages above produced.
    """
    argv = ["--config", GRPO_RECIPE, "--model_name_or_path", str(model), "--output", str(results_dir / f"{name}.json")]
    return evaluate_main([*argv, "--batch_size", str(EVAL_BATCH), "--image_control", control, "--overwrite", *extra])


def sample(model: Path, name: str, results_dir: Path, extra: list[str]) -> dict:
    """pass@k of `model` on the same images: k samples each, at the GRPO recipe's training temperature."""
    output = results_dir / f"{name}_pass{PASS_K}.json"
    argv = ["--config", GRPO_RECIPE, "--model_name_or_path", str(model), "--output", str(output)]
    return pass_at_k_main([*argv, "--batch_size", str(EVAL_BATCH), "--k", str(PASS_K), *extra])


def evaluate_all(model: Path, name: str, label: str, results_dir: Path, extra: list[str], training: str) -> Evaluated:
    greedy = evaluate(model, name, results_dir, extra, "none")
    blank = evaluate(model, f"{name}_blank", results_dir, extra, "blank")
    return Evaluated(label, greedy, blank, sample(model, name, results_dir, extra), training)


def _trained_for(run_dir: Path) -> str:
    steps, seconds = train_seconds(run_dir)
    return f"{steps} steps, {seconds:.0f} s"


Runs = list[tuple[Path, str, str, str]]  # (run folder, result name, column label, training) of each model
Trained = tuple[Path, Runs]  # the GRPO run, and every model of the experiment


def train_experiment(experiment: Experiment, args: argparse.Namespace, runs_dir: Path, clock: StageClock) -> Trained:
    """Train the experiment's models, reusing finished runs: warm start, GRPO from it (and the SFT control)."""
    run_name = args.run_name + experiment.run_suffix
    quick_sft, quick_grpo = (QUICK_SFT, QUICK_GRPO) if args.quick else ([], [])
    logs = Path(args.results_dir).resolve() / "logs"

    def log(stage: str) -> Path | None:  # stages side by side write to files, one at a time to the terminal
        return logs / f"{run_name}-{stage}.log" if args.jobs > 1 else None

    with clock.stage(f"{experiment.title}: supervised warm start (TRL SFTTrainer)"):
        warm_run = run_stage(
            "recipes/sft.py", experiment.sft_recipe, runs_dir, run_name, quick_sft, args.fresh, log("sft")
        )
    with clock.stage(f"{experiment.title}: GRPO (TRL GRPOTrainer)"):
        grpo_extra = ["--model_name_or_path", str(warm_run), *quick_grpo]
        grpo_run = run_stage("recipes/train.py", GRPO_RECIPE, runs_dir, run_name, grpo_extra, args.fresh, log("grpo"))
    runs = [(warm_run, "warm_start", "warm start", "–"), (grpo_run, "grpo", "after GRPO", _trained_for(grpo_run))]
    if experiment.sft_control:
        with clock.stage(f"{experiment.title}: control, more SFT on the same demonstrations for the GRPO stage's time"):
            steps = control_steps(warm_run, grpo_run)
            control_extra = ["--model_name_or_path", str(warm_run), *quick_sft, "--max_steps", str(steps)]
            control_run = run_stage(
                "recipes/sft.py",
                experiment.sft_recipe,
                runs_dir,
                f"{run_name}-control",
                control_extra,
                args.fresh,
                log("control"),
            )
        runs.append((control_run, "sft_control", "SFT control (more SFT)", _trained_for(control_run)))
    return grpo_run, runs


def evaluate_experiment(
    experiment: Experiment, runs: Runs, args: argparse.Namespace, clock: StageClock
) -> list[Evaluated]:
    """Every model of the experiment on the held-out images, in this process (one evaluation at a time)."""
    results_dir = Path(args.results_dir).resolve()
    eval_extra = QUICK_EVAL if args.quick else []
    with clock.stage(f"{experiment.title}: held-out evaluation (greedy real and blank, pass@{PASS_K})"):
        return [
            evaluate_all(run, experiment.results_prefix + name, label, results_dir, eval_extra, training)
            for run, name, label, training in runs
        ]


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _distinct(summary: dict[str, Any]) -> str:
    return str(round(summary["distinct_output_rate"] * summary["n"]))


def _count_row(count: str, model: Evaluated) -> str:
    greedy = model.greedy["summary"]["accuracy_by_count"].get(count)
    sampled = model.sampled["summary"]
    pass_1, pass_k = sampled["pass_at_1_by_count"].get(count), sampled["pass_at_k_by_count"].get(count)
    return f"{_pct(greedy)} · {_pct(pass_1)} · {_pct(pass_k)}"


def _rows(models: list[Evaluated]) -> list[tuple[str, list[str]]]:
    """The table's rows: name and one cell per model, all read from the result files."""
    greedy = [m.greedy["summary"] for m in models]
    sampled = [m.sampled["summary"] for m in models]
    blank = [m.blank["summary"] for m in models]
    first = models[0].greedy
    temperature = models[0].sampled["metadata"]["decoding"]["temperature"]
    counts = sorted({r["gold"] for r in first["records"]}, key=int)
    sizes = {c: sum(1 for r in first["records"] if r["gold"] == c) for c in counts}
    rows = [
        ("held-out images (n)", [str(s["n"]) for s in greedy]),
        ("accuracy (strict: last \\boxed{N} right)", [_pct(s["accuracy"]) for s in greedy]),
        *[
            (f"{c}-shape images (n = {sizes[c]}): greedy · pass@1 · pass@{PASS_K}", [_count_row(c, m) for m in models])
            for c in counts
        ],
        ("lenient accuracy (final number right)", [_pct(s["lenient_accuracy"]) for s in greedy]),
        ("format rate (ends with \\boxed{N})", [_pct(s["format_rate"]) for s in greedy]),
        ("accuracy among formatted", [_pct(s["conditional_accuracy"]) for s in greedy]),
        *[(f"reward part `{k}`", [f"{s['rewards'][k]:.3f}" for s in greedy]) for k in greedy[0]["rewards"]],
        (f"pass@1 (one sample at temperature {temperature:g})", [_pct(s["pass_at_1"]) for s in sampled]),
        (f"pass@{PASS_K} (some of {PASS_K} samples right)", [_pct(s["pass_at_k"]) for s in sampled]),
        ("training after the warm start (train_runtime)", [m.training for m in models]),
        ("-- honesty checks --", ["" for _ in models]),
        ("distinct greedy outputs across the images", [_distinct(s) for s in greedy]),
        ("strict accuracy with a blank image", [_pct(s["accuracy"]) for s in blank]),
        ("lenient accuracy with a blank image", [_pct(s["lenient_accuracy"]) for s in blank]),
        ("completions cut off at the length limit", [_pct(s["hit_limit_rate"]) for s in greedy]),
        (f"samples cut off at the length limit (pass@{PASS_K})", [_pct(s["hit_limit_rate"]) for s in sampled]),
    ]
    return rows


def _mcnemar(first: Evaluated, second: Evaluated) -> tuple[str, float]:
    test = mcnemar_exact(first.greedy["records"], second.greedy["records"])
    line = (
        f"McNemar exact test on strict accuracy, {first.label} → {second.label}: {test['b']} images right only with "
        f"'{first.label}', {test['c']} only with '{second.label}', p = {test['p_value']:.3g}."
    )
    return line, test["p_value"]


def report(experiment: Experiment, models: list[Evaluated]) -> tuple[str, dict[str, Any]]:
    """One experiment's table, McNemar's tests and headline facts, computed from the result files' records."""
    lines = [f"## {experiment.title}", "", "| | " + " | ".join(m.label for m in models) + " |"]
    lines.append("|---" * (len(models) + 1) + "|")
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in _rows(models)]
    warm, grpo, *control = models
    pairs = [(warm, grpo)]
    if control:  # GRPO against the control, and whether the control moved off its warm start at all
        pairs += [(control[0], grpo), (warm, control[0])]
    tests = [_mcnemar(first, second) for first, second in pairs]
    lines += ["", *(line for line, _ in tests)]
    accuracy = {m.label: m.greedy["summary"]["accuracy"] for m in models}
    facts: dict[str, Any] = {
        "p_value": tests[0][1],
        "accuracy_gain": accuracy[grpo.label] - accuracy[warm.label],
        "blank_gap_after": accuracy[grpo.label] - grpo.blank["summary"]["accuracy"],
        "cut_off_after": grpo.greedy["summary"]["hit_limit_rate"],
    }
    if control:
        facts["p_value_vs_control"] = tests[1][1]
        facts["gain_vs_control"] = accuracy[grpo.label] - accuracy[control[0].label]
    return "\n".join(lines), facts


def _bar_metrics(focus: int | None) -> dict[str, Any]:
    """What the bars show: name -> value of an `Evaluated`; with a mislabelled count, that count's own accuracy."""
    metrics = {"strict accuracy": lambda m: m.greedy["summary"]["accuracy"]}
    if focus is None:
        metrics["lenient accuracy"] = lambda m: m.greedy["summary"]["lenient_accuracy"]
        metrics["format rate"] = lambda m: m.greedy["summary"]["format_rate"]
    else:
        metrics[f"{focus} shapes: strict"] = lambda m: m.greedy["summary"]["accuracy_by_count"].get(str(focus))
        metrics[f"{focus} shapes: pass@1"] = lambda m: m.sampled["summary"]["pass_at_1_by_count"].get(str(focus))
    metrics[f"pass@{PASS_K}"] = lambda m: m.sampled["summary"]["pass_at_k"]
    metrics["strict, blank image"] = lambda m: m.blank["summary"]["accuracy"]
    return metrics


def plot(results: list[tuple[Experiment, Path, list[Evaluated]]], path: Path) -> None:
    """Per experiment: GRPO's training curves (TensorBoard events) and every model's held-out results as bars."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    figure = Figure(figsize=(13, 4.6 * len(results)))
    axes = figure.subplots(len(results), 2, squeeze=False)
    for (curves, bars), (experiment, grpo_run, models) in zip(axes, results, strict=True):
        events = _scalars(grpo_run)
        for tag, label in CURVES.items():
            if f"train/{tag}" in events.Tags()["scalars"]:
                points = events.Scalars(f"train/{tag}")
                curves.plot([p.step for p in points], [p.value for p in points], label=label)
        curves.set(title=f"{experiment.title}\nGRPO training (batch means)", xlabel="GRPO step")
        curves.set(ylabel="share of the batch's completions", ylim=(-0.02, 1.02))
        curves.legend(fontsize=8, loc="center right")
        metrics = _bar_metrics(experiment.focus_count)
        width = 0.8 / len(models)
        for index, model in enumerate(models):
            xs = [x + (index - (len(models) - 1) / 2) * width for x in range(len(metrics))]
            values = [metric(model) for metric in metrics.values()]
            drawn = bars.bar(xs, [v or 0.0 for v in values], width=width, label=model.label)
            labels = ["–" if v is None else f"{100 * v:.0f}%" for v in values]
            bars.bar_label(drawn, labels=labels, fontsize=7, padding=1)
        bars.set_xticks(range(len(metrics)), list(metrics), fontsize=8)
        n = models[0].greedy["summary"]["n"]
        temperature = models[0].sampled["metadata"]["decoding"]["temperature"]
        bars.set(title=f"held-out images (n = {n}), greedy; pass@k: {PASS_K} samples at T = {temperature:g}")
        bars.set(ylabel="share of held-out images")
        bars.set(ylim=(0, 1.25), yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0])
        bars.legend(fontsize=8, loc="upper center", ncol=len(models))
        for axis in (curves, bars):
            axis.yaxis.set_major_formatter(PercentFormatter(1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", default="runs", help="where the training runs go (TensorBoard: --logdir here)")
    parser.add_argument("--results-dir", default="results/demo", help="where the result files, tables and PNG go")
    parser.add_argument("--run-name", default="demo")
    parser.add_argument("--quick", action="store_true", help="toy-sized run of every stage (for tests)")
    parser.add_argument("--fresh", action="store_true", help="redo every stage instead of reusing finished ones")
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(len(EXPERIMENTS), usable_cores()),
        choices=range(1, len(EXPERIMENTS) + 1),
        help="experiments trained side by side (default: one per core, at most 2); 1 runs every stage in turn, "
        "its output on the terminal",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    runs_dir, results_dir = Path(args.runs_dir).resolve(), Path(args.results_dir).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    # Stages side by side share the cores: without a choice of the user's, each gets its share (1 on 2 cores).
    os.environ.setdefault("OMP_NUM_THREADS", str(default_threads(args.jobs)))

    clock = StageClock()
    with clock.stage("embedded tiny VLM"):
        print(resolve_model_path(TINY_MODEL))
    results, tables, facts = [], [], {}
    with ThreadPoolExecutor(max_workers=len(EXPERIMENTS)) as pool:
        if args.jobs > 1:  # every experiment's training starts now; each is evaluated as soon as it is trained
            futures = [pool.submit(train_experiment, e, args, runs_dir, clock) for e in EXPERIMENTS]
            trained: Iterator[Trained] = (future.result() for future in futures)
        else:  # one stage at a time: each experiment trains after the one before was evaluated
            trained = (train_experiment(e, args, runs_dir, clock) for e in EXPERIMENTS)
        try:
            for experiment, (grpo_run, runs) in zip(EXPERIMENTS, trained, strict=True):
                models = evaluate_experiment(experiment, runs, args, clock)
                table, facts[experiment.title] = report(experiment, models)
                results.append((experiment, grpo_run, models))
                tables.append(table)
        # A failed stage (run_stage raises SystemExit) or evaluation; Ctrl-C has reached the stages already (one
        # process group), so KeyboardInterrupt is left out.
        except (Exception, SystemExit):
            for process in list(RUNNING):
                process.terminate()
            raise

    png = results_dir / "demo.png"
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
    text = "\n\n".join([*tables, clock.table(), footer]) + "\n"
    (results_dir / "report.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"figure: {png}\nresult files: {results_dir}\nTensorBoard: tensorboard --logdir {runs_dir}")
    return {"experiments": facts, "wall_seconds": wall, "peak_rss_gib": peak_gib, "png": str(png)}


if __name__ == "__main__":
    main()
