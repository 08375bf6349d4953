"""Compare training runs: a PNG grid of their main curves and a markdown table of final and best values.

    python eval/compare_runs.py runs/shapes/*/* [--output results/runs_compare] [--smoothing 0.6]

Each argument is a run folder (`runs/<task>/<recipe>/<run>`: TensorBoard events plus the resolved `recipe.yaml`) or
a folder above run folders, which is searched. Curves come from TensorBoard's own event reader; the config comes
from each run's `recipe.yaml`, and only the keys whose values differ between the runs are shown, in the legend and
in the table. SFT and GRPO runs log different metrics, so they are compared in separate groups (the trainer is read
from the logged tags). Only metrics that form a curve and are not flat are drawn; the table says which were left out.
Writes `<output>.png` (one kind of run) or `<output>_grpo.png` and `<output>_sft.png`, and `<output>.md`; headless
(matplotlib's `Figure` without pyplot: Agg).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from vision_grpo.evaluation.training_curves import write_comparison


def main(argv: list[str] | None = None) -> tuple[list[Path], Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("runs", nargs="+", help="Run folders, or folders above them.")
    parser.add_argument(
        "--output", default="results/runs_compare", help="Writes <output>.md and <output>.png (or one per kind)."
    )
    parser.add_argument("--smoothing", type=float, default=0.6, help="TensorBoard-style smoothing in [0, 1).")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return write_comparison(args.runs, Path(args.output), args.smoothing)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
