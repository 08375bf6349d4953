"""`make demo`: the main job on the embedded default, offline on a CPU, in about ten minutes.

Stages: build the tiny VLM -> supervised warm start (recipes/sft.py) -> GRPO (recipes/train.py) -> evaluate the warm
start and the GRPO model on the same held-out images, with real and blank images (eval/evaluate.py) -> a before/after
table with McNemar's test and the honesty checks -> a PNG of the training curves and the before/after bars.

Every stage runs the repository's own entry points with the recipes in recipes/shapes/, so the demo exercises exactly
what users run. A finished stage is reused when the demo is run again (`--fresh` redoes everything).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vision_grpo.eval.compare import mcnemar_exact
from vision_grpo.eval.evaluate import main as evaluate_main
from vision_grpo.modeling import TINY_MODEL, resolve_model_path

REPO = Path(__file__).resolve().parent.parent
SFT_RECIPE = "recipes/shapes/tiny_sft.yaml"
GRPO_RECIPE = "recipes/shapes/tiny_grpo_demo.yaml"
# `--quick`: the same pipeline at toy size, for the end-to-end test (numbers mean nothing there).
QUICK_SFT = [
    "--max_steps",
    "6",
    "--shapes_train_size",
    "64",
    "--per_device_train_batch_size",
    "8",
    "--warmup_steps",
    "1",
]
QUICK_GRPO = ["--max_steps", "2", "--shapes_train_size", "32", "--per_device_train_batch_size", "16"]
QUICK_EVAL = ["--shapes_eval_size", "24"]
CURVES = {
    "reward": "strict reward (boxed answer right)",
    "rewards/count_correct/mean": "lenient correctness",
    "rewards/count_format/mean": "format rate",
    "completions/clipped_ratio": "cut off at the limit",
}


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def run_stage(script: str, recipe: str, runs_dir: Path, run_name: str, extra: list[str], fresh: bool) -> Path:
    """Run a training entry point unless its run folder already finished; return the run folder."""
    output_dir = runs_dir / Path(recipe).parent.name / Path(recipe).stem
    run_dir = output_dir / run_name
    manifest = run_dir / "manifest.json"
    if not fresh and manifest.exists() and json.loads(manifest.read_text()).get("ended"):
        print(f"reusing {run_dir} (finished earlier; --fresh to redo)")
        return run_dir
    command = [sys.executable, script, "--config", recipe, "--output_dir", str(output_dir), "--run_name", run_name]
    print(" ".join(command[1:] + extra), flush=True)
    subprocess.run(command + extra, cwd=REPO, check=True)
    return run_dir


def evaluate(model: Path, name: str, results_dir: Path, extra: list[str], control: str) -> dict:
    """Evaluate `model` on the GRPO recipe's held-out images (same prompts and pixels as training).

    Always redone (seconds): a result file must belong to the models the stages above produced.
    """
    output = results_dir / f"{name}.json"
    argv = ["--config", GRPO_RECIPE, "--model_name_or_path", str(model), "--output", str(output)]
    argv += ["--batch_size", "50", "--image_control", control, *extra]
    return evaluate_main(argv)


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _distinct(summary: dict[str, Any]) -> str:
    return str(round(summary["distinct_output_rate"] * summary["n"]))


def report(base: dict, trained: dict, base_blank: dict, trained_blank: dict) -> tuple[str, dict[str, Any]]:
    """The before/after table and the honesty checks, computed from the result files' records."""
    test = mcnemar_exact(base["records"], trained["records"])
    b, t = base["summary"], trained["summary"]
    rows = [
        ("held-out images (n)", str(b["n"]), str(t["n"])),
        ("accuracy (strict: last \\boxed{N} right)", _pct(b["accuracy"]), _pct(t["accuracy"])),
        ("lenient accuracy (final number right)", _pct(b["lenient_accuracy"]), _pct(t["lenient_accuracy"])),
        ("format rate (ends with \\boxed{N})", _pct(b["format_rate"]), _pct(t["format_rate"])),
        ("accuracy among formatted", _pct(b["conditional_accuracy"]), _pct(t["conditional_accuracy"])),
    ]
    rows += [(f"reward part `{k}`", f"{v:.3f}", f"{t['rewards'][k]:.3f}") for k, v in b["rewards"].items()]
    rows += [
        ("-- honesty checks --", "", ""),
        ("distinct greedy outputs across the images", _distinct(b), _distinct(t)),
        (
            "strict accuracy with a blank image",
            _pct(base_blank["summary"]["accuracy"]),
            _pct(trained_blank["summary"]["accuracy"]),
        ),
        (
            "lenient accuracy with a blank image",
            _pct(base_blank["summary"]["lenient_accuracy"]),
            _pct(trained_blank["summary"]["lenient_accuracy"]),
        ),
        ("completions cut off at the length limit", _pct(b["hit_limit_rate"]), _pct(t["hit_limit_rate"])),
    ]
    lines = ["| | warm start (before GRPO) | after GRPO |", "|---|---|---|"]
    lines += [f"| {name} | {before} | {after} |" for name, before, after in rows]
    lines.append(
        f"\nMcNemar exact test on strict accuracy: {test['b']} items right only before, {test['c']} right only "
        f"after, p = {test['p_value']:.3g}."
    )
    facts = {
        "p_value": test["p_value"],
        "accuracy_gain": t["accuracy"] - b["accuracy"],
        "blank_gap_after": t["accuracy"] - trained_blank["summary"]["accuracy"],
        "cut_off_after": t["hit_limit_rate"],
    }
    return "\n".join(lines), facts


def plot(grpo_run: Path, base: dict, trained: dict, trained_blank: dict, path: Path) -> None:
    """Training curves from the GRPO run's TensorBoard events, and before/after bars."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(grpo_run), size_guidance={"scalars": 0})
    events.Reload()
    figure = Figure(figsize=(12, 4.5))
    curves, bars = figure.subplots(1, 2)
    for tag, label in CURVES.items():
        if f"train/{tag}" in events.Tags()["scalars"]:
            points = events.Scalars(f"train/{tag}")
            curves.plot([p.step for p in points], [p.value for p in points], label=label)
    curves.set(title="GRPO training (tiny VLM, CPU)", xlabel="step", ylim=(-0.02, 1.02))
    curves.legend(fontsize=8)
    names = ["strict accuracy", "lenient accuracy", "format rate"]
    keys = ["accuracy", "lenient_accuracy", "format_rate"]
    xs = range(len(names))
    bars.bar([x - 0.27 for x in xs], [base["summary"][k] for k in keys], width=0.27, label="warm start")
    bars.bar(list(xs), [trained["summary"][k] for k in keys], width=0.27, label="after GRPO")
    bars.bar(
        [x + 0.27 for x in xs], [trained_blank["summary"][k] for k in keys], width=0.27, label="after GRPO, blank image"
    )
    bars.set_xticks(list(xs), names)
    bars.set(title=f"held-out images (n = {base['summary']['n']})", ylim=(0, 1))
    bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", default="runs", help="where the training runs go (TensorBoard: --logdir here)")
    parser.add_argument("--results-dir", default="results/demo", help="where the result files, table and PNG go")
    parser.add_argument("--run-name", default="demo")
    parser.add_argument("--quick", action="store_true", help="toy-sized run of every stage (for tests)")
    parser.add_argument("--fresh", action="store_true", help="redo every stage instead of reusing finished ones")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    runs_dir, results_dir = Path(args.runs_dir).resolve(), Path(args.results_dir).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)

    banner("1/5 embedded tiny VLM")
    print(resolve_model_path(TINY_MODEL))
    banner("2/5 supervised warm start (TRL SFTTrainer)")
    sft_run = run_stage(
        "recipes/sft.py", SFT_RECIPE, runs_dir, args.run_name, QUICK_SFT if args.quick else [], args.fresh
    )
    banner("3/5 GRPO (TRL GRPOTrainer)")
    grpo_extra = ["--model_name_or_path", str(sft_run)] + (QUICK_GRPO if args.quick else [])
    grpo_run = run_stage("recipes/train.py", GRPO_RECIPE, runs_dir, args.run_name, grpo_extra, args.fresh)
    banner("4/5 held-out evaluation: warm start vs GRPO, real and blank images")
    eval_extra = QUICK_EVAL if args.quick else []
    base = evaluate(sft_run, "warm_start", results_dir, eval_extra, "none")
    trained = evaluate(grpo_run, "grpo", results_dir, eval_extra, "none")
    base_blank = evaluate(sft_run, "warm_start_blank", results_dir, eval_extra, "blank")
    trained_blank = evaluate(grpo_run, "grpo_blank", results_dir, eval_extra, "blank")

    banner("5/5 report")
    table, facts = report(base, trained, base_blank, trained_blank)
    png = results_dir / "demo.png"
    plot(grpo_run, base, trained, trained_blank, png)
    wall = time.perf_counter() - start
    peak_gib = (
        max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 2**20
    )
    footer = (
        f"\nwall time {wall / 60:.1f} min (stages reused are not re-timed); peak RSS of any process {peak_gib:.2f} GiB"
    )
    (results_dir / "report.md").write_text(table + "\n" + footer + "\n", encoding="utf-8")
    print(table + footer)
    print(f"\nfigure: {png}\nresult files: {results_dir}\nTensorBoard: tensorboard --logdir {runs_dir}")
    return {**facts, "wall_seconds": wall, "peak_rss_gib": peak_gib, "png": str(png)}


if __name__ == "__main__":
    main()
