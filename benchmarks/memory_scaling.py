"""What costs what: s/step and peak memory of the tiny recipe as rollouts and image size grow; evaluator memory.

    python benchmarks/memory_scaling.py [--steps 5] [--quick]

Each row is one short run of `recipes/train.py` on the tiny recipe with a few keys changed:
- `num_generations` 2, 4, 8, 16 with 2 prompts per step (`per_device_train_batch_size` = 2 x generations: TRL
  counts completions), so the rollouts per step grow with the group size;
- image size through the processor's pixel limit: `max_pixels` = (k x 28)^2 gives k^2 image tokens per image
  (k = 4, 6, 9 on the 256-pixel canvas; k = 16 on a 448-pixel canvas);
- torch threads (OMP_NUM_THREADS) 1 and one per core: on a machine whose cores other work also uses, a parallel
  region waits for its slowest thread and more threads can be many times slower.
The other rows run with the inherited thread count (OMP_NUM_THREADS, else torch's default of one per core).
Peak memory is the run's peak resident set size (whole process, from `wait4`); s/step is the median wall time
between logged steps after the first. The evaluator's peak comes from one run of `eval/evaluate.py`.
One run per row: on a shared machine the seconds are indicative, the memory figures are not load-dependent.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from common import RECIPE, check, machine, markdown_table, report, run_measured
from train_overhead import run_once

PATCH = 28  # pixels per image token side for Qwen2.5-VL (14-pixel patches merged 2 x 2)


def inherited_threads() -> int:
    """The torch thread count a run gets from this environment: OMP_NUM_THREADS, else torch's default (cores)."""
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)


def configurations(quick: bool) -> list[dict[str, int]]:
    """The rows: group sizes, image sizes, then torch threads (1 and all cores); the recipe's row only once."""
    recipe = {"generations": 4, "batch": 8, "k": 6, "canvas": 256, "threads": inherited_threads()}
    generations = [4] if quick else [2, 4, 8, 16]
    sides = [(4, 256)] if quick else [(4, 256), (6, 256), (9, 256), (16, 448)]
    threads = [] if quick else sorted({1, os.cpu_count() or 1})
    rows = [{**recipe, "generations": g, "batch": 2 * g} for g in generations]
    rows += [{**recipe, "k": k, "canvas": canvas} for k, canvas in sides]
    rows += [{**recipe, "threads": t} for t in threads]
    unique: list[dict[str, int]] = []
    for row in rows:
        if row not in unique:
            unique.append(row)
    return unique


def overrides(row: dict[str, int]) -> list[str]:
    return [
        "--num_generations",
        str(row["generations"]),
        "--per_device_train_batch_size",
        str(row["batch"]),
        "--max_pixels",
        str((row["k"] * PATCH) ** 2),
        "--shapes_canvas",
        str(row["canvas"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps per row")
    parser.add_argument("--quick", action="store_true", help="smallest setting: 2 rows of 3 steps, 8 eval items")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps

    table: list[list[Any]] = []
    figures: dict[str, Any] = {"steps": steps, "machine": machine(), "train": []}
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        for index, row in enumerate(configurations(args.quick)):
            result = run_once("ours", Path(tmp) / str(index), steps, 0, overrides(row), row["threads"])
            label = " (tiny recipe)" if (row["generations"], row["batch"], row["k"]) == (4, 8, 6) else ""
            table.append(
                [
                    f"{row['generations']}{label}",
                    row["batch"],
                    f"{row['k'] ** 2} ({row['canvas']} px canvas)",
                    row["threads"],
                    result["s_per_step"],
                    result["cpu_s_per_step"],
                    result["peak_rss_mib"],
                ]
            )
            figures["train"].append({**row, **result})
            print(f"row {index + 1}: {row} -> {result}")

        items = 8 if args.quick else 32
        evaluated = check(
            run_measured(
                [
                    "eval/evaluate.py",
                    "--config",
                    str(RECIPE),
                    "--output",
                    f"{tmp}/eval.json",
                    "--limit",
                    str(items),
                    "--batch_size",
                    "8",
                ]
            ),
            "eval/evaluate.py",
        )
        figures["evaluator"] = {"items": items, "batch_size": 8, "peak_rss_mib": evaluated.peak_rss_mib}

    print(f"\nCost of rollouts and image size, tiny recipe, {steps} steps per row ({machine()})")
    headers = ["num_generations", "completions/step", "image tokens", "torch threads", "s/step", "CPU s/step"]
    headers.append("peak RSS MiB")
    print(markdown_table(headers, table))
    print(
        f"evaluator (eval/evaluate.py, tiny recipe, {items} items, batch 8): peak RSS {evaluated.peak_rss_mib:.0f} MiB"
    )
    report("memory_scaling", figures, args.json)


if __name__ == "__main__":
    main()
