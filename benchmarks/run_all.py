"""Run every CPU benchmark (`make bench`) and print their figures, then one summary table for the README.

    python benchmarks/run_all.py [--quick] [--out DIR]

Each benchmark runs in its own process, one after the other (never two at once: they would time each other),
with one torch thread unless `--threads` says otherwise (see its help; memory_scaling compares thread counts).
Their own tables are printed as they finish; the summary at the end repeats the headline figures with the
date and the machine. `--quick` runs each at its smallest setting (the smoke test's; the figures mean little).
The GPU check (`gpu_check.py`) is not run here: it needs a GPU (`--dry-run` runs it anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

from common import REPO, machine, markdown_table
from step_profile import TRAINING_STEP

HERE = Path(__file__).resolve().parent
# Cheapest first, so a broken set-up fails in seconds.
BENCHMARKS = (
    "data_pipeline",
    "data_scale",
    "startup",
    "eval_throughput",
    "train_overhead",
    "step_profile",
    "memory_scaling",
    "replica_costs",
    "vision_once",
    "training_pass_costs",
)


def run(name: str, quick: bool, out: Path, env: dict[str, str]) -> dict[str, Any]:
    """One benchmark script; its figures from the JSON file it writes. Its warnings and progress bars (stderr)
    go to `<out>/<name>.log`, shown only if it fails."""
    figures_path, log = out / f"{name}.json", out / f"{name}.log"
    command = [sys.executable, str(HERE / f"{name}.py"), "--json", str(figures_path), *(["--quick"] if quick else [])]
    print(f"\n=== {name} ===", flush=True)
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as stderr:
        returncode = subprocess.run(command, cwd=REPO, stderr=stderr, env=env, check=False).returncode
    if returncode != 0:
        sys.exit(f"{name} failed ({returncode}); its log:\n{log.read_text(encoding='utf-8')[-5000:]}")
    print(f"({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    return json.loads(figures_path.read_text(encoding="utf-8"))


def summary(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """The README's rows: figure, value, target."""
    overhead, startup = results["train_overhead"], results["startup"]
    evaluation, scaling, data = results["eval_throughput"], results["memory_scaling"], results["data_pipeline"]
    recipe_rows = [r for r in scaling["train"] if (r["generations"], r["batch"], r["k"]) == (4, 8, 6)]
    recipe_row = recipe_rows[0]  # the run with the inherited thread count
    profiled = results["step_profile"]["ours"]
    hooks, step = profiled["our per-step hooks (reward checks, callbacks, sampler)"], profiled[TRAINING_STEP]
    stages, packed = startup["stages_s"], results["training_pass_costs"]
    imports = sum(v for k, v in stages.items() if k.startswith("import"))
    return [
        # CPU seconds: the same tokens on both sides (checked), and far less moved by other work on the machine.
        [
            "training CPU s/step, ours / bare TRL (median of pairs)",
            f"{overhead['cpu_s_per_step']['ratio']:.3f}",
            "<= 1.05",
        ],
        ["training wall s/step, ours / bare TRL", f"{overhead['s_per_step']['ratio']:.3f} ({overhead['load']})", "-"],
        ["training s/step, ours (tiny recipe)", f"{overhead['s_per_step']['ours']:.2f} s", "-"],
        ["our per-step code (profiled) / TRL's training_step", f"{1000 * hooks:.1f} ms / {step:.2f} s", "-"],
        ["start-up to first step, ours / bare TRL", f"{overhead['startup_s']['ratio']:.2f}", "-"],
        ["start-up stages: imports / all (startup.py)", f"{imports:.1f} s / {startup['warm_total_s']:.1f} s", "-"],
        ["first step, ours / bare TRL", f"{overhead['first_step_s']['ratio']:.2f}", "-"],
        ["evaluator batched / one at a time (samples/s)", f"{evaluation['batching_speedup']:.1f}x", ">= 4x"],
        ["evaluator, adapter merged / unmerged", f"{evaluation['merged_vs_unmerged']:.2f}x", "-"],
        *[
            [f"tiny recipe s/step with {r['threads']} torch thread(s)", f"{r['s_per_step']:.2f} s", "-"]
            for r in recipe_rows
        ],
        ["peak RSS, tiny recipe training", f"{recipe_row['peak_rss_mib']:.0f} MiB", "-"],
        ["peak RSS, evaluator", f"{scaling['evaluator']['peak_rss_mib']:.0f} MiB", "-"],
        ["dataset preparation, tiny recipe / demo recipe", _prep(data), "small next to a run"],
        [
            f"step time per-copy / shared vision, frozen tower, G = {results['vision_once']['copies']}",
            f"{results['vision_once']['step_ratio_frozen']:.2f}x",
            ">= 1.5x",
        ],
        ["training pass time TRL's / packed (training_pass_costs.py)", f"{packed['pass_ratio']:.2f}x", ">= 3x"],
        ["step time TRL's pass / packed", f"{packed['step_ratio']:.2f}x", ">= 2x"],
        ["training peak memory TRL's pass / packed", f"{packed['peak_memory_ratio']:.2f}x", ">= 1.5x"],
        *[
            [f"VQA rows: first / second start, {size['rows']} rows (data_scale.py)", _starts(size), "second <= 15 s"]
            for size in results["data_scale"]["sizes"]
        ],
    ]


def _prep(data: dict[str, Any]) -> str:
    seconds = data["preparation_s"]
    return f"{seconds['tiny recipe']:.1f} s / {seconds['demo recipe']:.1f} s"


def _starts(size: dict[str, Any]) -> str:
    first, second = size["first"], size["second"]
    return f"{first['seconds']:.1f} s, {first['peak_rss_mib']:.0f} MiB / {second['seconds']:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark at its smallest setting")
    parser.add_argument("--out", help="folder for each benchmark's JSON figures and log (default: a temporary one)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of every run (OMP_NUM_THREADS; 0: torch's default, one per core). 1 by default: on a "
        "machine whose cores other work also uses, more threads made the tiny recipe 10-100x slower; "
        "memory_scaling measures both",
    )
    args = parser.parse_args()
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    threads = env.get("OMP_NUM_THREADS", "torch default")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        results = {name: run(name, args.quick, out, env) for name in BENCHMARKS}
    minutes = (time.perf_counter() - start) / 60
    when = f"{date.today().isoformat()}, {machine()}, torch threads: {threads}"
    print(f"\n=== summary: {when}, {minutes:.1f} min{' (--quick)' * args.quick} ===")
    print(markdown_table(["figure", "measured", "target"], summary(results)))


if __name__ == "__main__":
    main()
