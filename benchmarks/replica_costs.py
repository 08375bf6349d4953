"""The three embedded replicas side by side: build time, parameters, s/step and peak memory of the tiny recipe.

    python benchmarks/replica_costs.py [--steps 8] [--quick]

Per family (Qwen2.5-VL, Qwen3-VL, Qwen3.5): the seconds `build_replica` takes into a fresh folder (tokenizer
training, random weights, save), the parameter count, and one run of `recipes/train.py` on
`recipes/shapes/tiny_cpu.yaml` with only `--model_name_or_path` changed, measured as benchmarks/train_overhead.py
measures ours (median wall seconds between logged steps after warm-up, CPU seconds per step, peak resident memory
of the whole process). The families run one after the other, so on a shared machine compare them with care: the
CPU s/step moves less with load than the wall figure. Qwen3.5 runs its linear-attention layers with transformers'
plain-torch fallback here (no flash-linear-attention or causal-conv1d kernels on CPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from common import machine, markdown_table, report
from train_overhead import run_once

from vision_grpo.models.embedded import EMBEDDED_FAMILIES
from vision_grpo.models.replicas.build import build_replica


def build_figures(family: str, workdir: Path) -> dict[str, Any]:
    """Seconds to build the replica into a fresh folder, and its parameter count."""
    from transformers import AutoModelForImageTextToText

    start = time.perf_counter()
    folder = build_replica(family, workdir / family)
    seconds = time.perf_counter() - start
    parameters = sum(p.numel() for p in AutoModelForImageTextToText.from_pretrained(folder).parameters())
    return {"build_s": seconds, "parameters": parameters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per family")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the default replica only, 3 steps: a smoke run of this script (the replicas themselves are trained by "
        "the test suite), the figures mean little",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    steps, warmup = (3, 0) if args.quick else (args.steps, 1)
    figures: dict[str, Any] = {"machine": machine(), "steps": steps, "families": {}}
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        for name, family in list(EMBEDDED_FAMILIES.items())[: 1 if args.quick else None]:
            workdir = Path(tmp) / family
            workdir.mkdir()
            run = run_once("ours", workdir, steps, warmup, ["--model_name_or_path", name])
            figures["families"][name] = {**build_figures(family, workdir), **run}
    rows = [
        [name, f["build_s"], f"{f['parameters']:,}", f["s_per_step"], f["cpu_s_per_step"], f["peak_rss_mib"]]
        for name, f in figures["families"].items()
    ]
    headers = ["replica", "build s", "parameters", "s/step", "CPU s/step", "peak RSS MiB"]
    print(markdown_table(headers, rows))
    report("replica_costs", figures, args.json)


if __name__ == "__main__":
    main()
