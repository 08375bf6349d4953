"""The spread of Experiments 3 and 5 over training seeds: each arm's held-out accuracy per seed, its mean and range,
and McNemar's test of GRPO against the SFT control on each seed's paired images; a claim holds only where it holds on
every seed. Reads the result files that `python -m vision_grpo.demo --experiments perception generalization --seed S`
wrote (the recipes' own seed: the unseeded runs), so it trains and evaluates nothing itself.

    python -m vision_grpo.demo.seeds --seeds 42 43 44 [--results-dir results/demo]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import yaml

from vision_grpo.demo.demo_command import write_report
from vision_grpo.demo.experiments import EXPERIMENTS, REPO, Experiment
from vision_grpo.evaluation.statistics import mcnemar_exact

ARMS = {"warm_start": "warm start", "grpo": "after GRPO", "sft_control": "SFT control (more SFT)"}
KEYS = ("perception", "generalization")


def _of_seed(experiment: Experiment, seed: int) -> Experiment:
    """The experiment as `--seed seed` ran it; the recipes' own seed is the unseeded run."""
    recipe_seed = yaml.safe_load((REPO / experiment.grpo_recipe).read_text(encoding="utf-8"))["seed"]
    return experiment if seed == recipe_seed else experiment.seeded(seed)


def _sets(experiment: Experiment) -> list[tuple[str, str]]:
    """(held-out set, result name stem): the recipe's own set, or each of Experiment 5's."""
    if not experiment.held_out_variants:
        return [("held out", "")]
    return [(name, name.replace(" ", "_") + "_") for name, _ in experiment.held_out_variants]


def _result(experiment: Experiment, stem: str, arm: str, results_dir: Path) -> dict[str, Any]:
    path = results_dir / f"{experiment.results_prefix}{stem}{arm}.json"
    if not path.is_file():
        seed = "" if experiment.seed is None else f" --seed {experiment.seed}"
        raise SystemExit(
            f"{path} is missing: run `python -m vision_grpo.demo --experiments {experiment.key}{seed}` first"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def spread(experiment: Experiment, seeds: list[int], results_dir: Path) -> str:
    """The experiment's section over `seeds`: per held-out set and arm, accuracy per seed, mean and range; per set
    and seed, McNemar's test of GRPO against the control; and whether GRPO's side holds on every seed."""
    runs = [_of_seed(experiment, seed) for seed in seeds]
    heads = " | ".join(f"seed {seed}" for seed in seeds)
    lines = [
        f"## {experiment.title}: {len(seeds)} seeds",
        "",
        f"| held-out set, arm | {heads} | mean | range |",
        "|---" * (len(seeds) + 3) + "|",
    ]
    verdicts = []
    for name, stem in _sets(experiment):
        results = {arm: [_result(run, stem, arm, results_dir) for run in runs] for arm in ARMS}
        for arm, label in ARMS.items():
            values = [100 * result["summary"]["accuracy"] for result in results[arm]]
            cells = " | ".join(f"{value:.1f}%" for value in values)
            mean, low, high = statistics.mean(values), min(values), max(values)
            lines.append(f"| {name}, {label} | {cells} | {mean:.1f}% | {low:.1f}-{high:.1f}% |")
        tests = [
            mcnemar_exact(g["records"], c["records"])
            for g, c in zip(results["grpo"], results["sft_control"], strict=True)
        ]
        cells = " | ".join(f"{t['b']} vs {t['c']}, p = {t['p_value']:.2g}" for t in tests)
        lines.append(f"| {name}, GRPO vs control (McNemar) | {cells} | | |")
        ahead = ["GRPO" if t["b"] > t["c"] else "control" if t["c"] > t["b"] else "neither" for t in tests]
        significant = sum(t["p_value"] < 0.05 for t in tests)
        holds = len(set(ahead)) == 1 and ahead[0] != "neither" and significant == len(tests)
        verdicts.append(
            f"- {name}: ahead per seed {', '.join(ahead)}; p < 0.05 on {significant} of {len(tests)}: "
            + (f"**{ahead[0]} ahead on every seed**" if holds else "no claim (it does not hold on every seed)")
        )
    return "\n".join([*lines, "", *verdicts])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m vision_grpo.demo.seeds", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, required=True, help="the training seeds, e.g. 42 43 44")
    parser.add_argument("--results-dir", default="results/demo", help="where the demo wrote its result files")
    parser.add_argument("--experiments", nargs="+", choices=KEYS, default=list(KEYS))
    args = parser.parse_args(argv)
    if len(set(args.seeds)) < 2 or len(set(args.seeds)) < len(args.seeds):
        parser.error(f"--seeds {args.seeds}: give two or more different seeds")
    results_dir = Path(args.results_dir).resolve()
    (results_dir / "sections").mkdir(parents=True, exist_ok=True)
    for experiment in (e for e in EXPERIMENTS if e.key in args.experiments):
        section = spread(experiment, args.seeds, results_dir)
        (results_dir / "sections" / f"{experiment.key}-seeds.md").write_text(section + "\n", encoding="utf-8")
        print(section + "\n")
    return write_report(results_dir, [])


if __name__ == "__main__":
    main()
