"""Why the demo's warm start does not reproduce across machines: the same SFT run (Experiment 3's warm start recipe,
the first `--steps` steps) under the CPU kernels torch and MKL pick on this machine, again (run-to-run), and with
the kernels a CPU without AVX-512 would get (`ATEN_CPU_CAPABILITY=avx2`, `MKL_CBWR=AVX2`, `ONEDNN_MAX_CPU_ISA=AVX2`).
Prints the loss at each logged step, the largest weight difference from the first run and each model's greedy
strict accuracy on the GRPO recipe's held-out images (n = 300, as the demo evaluates them).

    python benchmarks/determinism.py [--steps 400] [--json results/determinism.json]
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import torch
from common import REPO, run_measured
from safetensors.torch import load_file

RECIPE = "recipes/shapes/tiny_sft_perception.yaml"
HELD_OUT = "recipes/shapes/tiny_grpo_perception.yaml"  # its held-out images: the demo's
LOSS = re.compile(r"\{'loss': '([0-9.e+-]+)'")
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
VARIANTS = {
    "this CPU's kernels": {},
    "this CPU's kernels, again": {},
    "torch's AVX2 kernels only (ATEN_CPU_CAPABILITY=avx2)": {"ATEN_CPU_CAPABILITY": "avx2"},
    "every library on AVX2 kernels": AVX2,
}


def train(name: str, env: dict[str, str], steps: int, runs: Path) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The warm start's first `steps` steps under `env`: its logged losses, its weights and its held-out accuracy
    (evaluated with this machine's kernels, so that only training differs)."""
    run_name = name.split(" (")[0].replace(" ", "_").replace(",", "").replace("'", "")
    argv = ["recipes/sft.py", "--config", RECIPE, "--output_dir", str(runs), "--run_name", run_name]
    argv += ["--max_steps", str(steps), "--logging_steps", "10", "--report_to", "none"]
    measured = run_measured(argv, env={"OMP_NUM_THREADS": "1", **env})
    if measured.returncode != 0:
        raise SystemExit(f"{name}: training failed\n{measured.output[-3000:]}")
    losses = [float(value) for value in LOSS.findall(measured.output)]  # the Trainer's printed logs
    result = runs / f"{run_name}.json"
    argv = ["eval/evaluate.py", "--config", HELD_OUT, "--model_name_or_path", str(runs / run_name)]
    evaluated = run_measured([*argv, "--output", str(result), "--batch_size", "50"], env={"OMP_NUM_THREADS": "1"})
    if evaluated.returncode != 0:
        raise SystemExit(f"{name}: evaluation failed\n{evaluated.output[-3000:]}")
    accuracy = json.loads(result.read_text())["summary"]["accuracy"]
    return losses, load_file(runs / run_name / "model.safetensors"), accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="400: the demo's warm start")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO / ".cache" if (REPO / ".cache").is_dir() else None) as folder:
        results = {name: train(name, env, args.steps, Path(folder)) for name, env in VARIANTS.items()}
    (_, first, _), *_ = results.values()
    rows = []
    print("| kernels | last 3 logged losses | largest weight difference from the first run | held-out accuracy |")
    print("|---|---|---|---|")
    for name, (losses, weights, accuracy) in results.items():
        diff = max((weights[key] - first[key]).abs().max().item() for key in first)
        rows.append({"kernels": name, "losses": losses, "max_weight_diff": diff, "held_out_accuracy": accuracy})
        print(f"| {name} | {', '.join(f'{loss:.6f}' for loss in losses[-3:])} | {diff:.3g} | {100 * accuracy:.1f}% |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
