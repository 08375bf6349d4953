"""Compare evaluation results of the same items: a markdown table, paired significance tests and a bar chart.

    python eval/compare.py results/base.json results/step100.json [--output results/eval_compare.md] [--overwrite]

Each argument is a JSON file written by `eval/evaluate.py`. The first file is the reference: the table gives every
run's change against it in percentage points, and McNemar's exact test says whether the accuracy difference on
the same items could be chance. A run with `--image_control blank|shuffled` is paired with the run on real images
of the same model and adapter, and the accuracy drop is reported (a model that ignores the image shows none).
Files of different item sets (other ids, or other gold answers for the same ids), and a file given twice (however
spelled or linked), are refused. Writes the report to `--output` (default `results/eval_compare.md`) and the bar
chart beside it with `.png` (or to `--plot`); `eval/compare_runs.py`, which compares training curves, defaults to
`results/runs_compare.*`, so the two never overwrite each other. An earlier comparison there is replaced only with
`--overwrite`, and a file of another kind never. Headless (matplotlib's `Figure`, no pyplot).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vision_grpo.evaluation.comparison import (
    DEFAULT_REPORT,
    OutputExists,
    check_distinct,
    check_outputs,
    default_names,
    load_result,
    plot_comparison,
    plot_path,
    report,
)
from vision_grpo.evaluation.statistics import ResultError
from vision_grpo.run.outputs import OutputIsInput, check_outputs_are_not_inputs


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("results", nargs="+", help="Result JSON files of eval/evaluate.py; the first is the reference.")
    parser.add_argument("--names", nargs="+", help="One label per file (default: the file names).")
    parser.add_argument("--output", default=DEFAULT_REPORT, help="The markdown report (also printed).")
    parser.add_argument("--plot", help="PNG bar chart of accuracy and format rate (default: --output with .png).")
    parser.add_argument("--overwrite", action="store_true", help="Replace an earlier comparison at these paths.")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if len(args.results) < 2:
        parser.error("give two or more result files")
    paths = [Path(p) for p in args.results]
    names = args.names or default_names(paths)
    if len(names) != len(paths):
        parser.error(f"--names has {len(names)} labels for {len(paths)} files")
    check_distinct(paths)
    output, plot = Path(args.output), Path(args.plot) if args.plot else plot_path(args.output)
    inputs = {f"result file {i + 1}": path for i, path in enumerate(paths)}
    for flag, path in (("--output", output), ("--plot", plot)):
        check_outputs_are_not_inputs(flag, [path], inputs)
    check_outputs(output, plot, args.plot is not None, args.overwrite)
    results = [load_result(path) for path in paths]
    markdown = report(results, names)
    for path in (output, plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(markdown, encoding="utf-8")
    plot_comparison(results, names, plot)
    print(markdown)
    print(f"wrote {output} and {plot}")
    return markdown


if __name__ == "__main__":
    try:
        main()
    # Unreadable or repeated files, other items, an output that is an input or an earlier comparison: the message
    # says it all.
    except (ResultError, OutputIsInput, OutputExists) as error:
        sys.exit(f"error: {error}")
