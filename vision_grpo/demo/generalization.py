"""Experiment 5: Experiment 3's arms (warm start, GRPO, the SFT control at equal token-passes) on held-out images drawn
out of the training distribution, each variant a recipe-expressible change of the generator with a seed of its own
(`held_out_variants` in demo/experiments.py, chosen and written down in docs/demo.md before any model was evaluated on
them).

Per variant and arm: greedy strict accuracy and its drop from the in-distribution figure, the blank-image control,
McNemar's test of GRPO against the control; the held-out accuracy of both arms' checkpoints against compute on the
variant that separates them most; a PNG of it all.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from vision_grpo.demo.curve import compute_curve, curve_table, plot_curve
from vision_grpo.demo.experiments import QUICK_EVAL, Experiment
from vision_grpo.demo.stages import Evaluated, Runs, StageClock, evaluate
from vision_grpo.evaluation.statistics import mcnemar_exact

Variants = dict[str, list[Evaluated]]  # held-out set -> each arm's greedy and blank results, in `Runs` order


def evaluate_variants(
    experiment: Experiment, runs: Runs, results_dir: Path, quick: bool, clock: StageClock
) -> Variants:
    """Every arm's final model on every held-out set, greedy on real and on blank images (result files named
    `<prefix><set>_<arm>[_blank].json`)."""
    extra = QUICK_EVAL if quick else []
    found: Variants = {}
    for variant, flags in experiment.held_out_variants:
        slug = variant.replace(" ", "_")
        with clock.stage(f"{experiment.title}: {variant} (greedy, real and blank images)"):
            found[variant] = [
                Evaluated(
                    label,
                    *(
                        evaluate(
                            run,
                            experiment.grpo_recipe,
                            f"{experiment.results_prefix}{slug}_{name}{suffix}",
                            results_dir,
                            [*extra, *flags],
                            control,
                        )
                        for suffix, control in (("", "none"), ("_blank", "blank"))
                    ),
                    shuffled={},
                    sampled={},
                    training=training,
                )
                for run, name, label, training in runs
            ]
    return found


def _accuracy(model: Evaluated, blank: bool = False) -> float:
    return (model.blank if blank else model.greedy)["summary"]["accuracy"]


def separating_variant(variants: Variants) -> str:
    """The out-of-distribution set on which GRPO and the control differ most (the curve's set)."""
    shifted = [name for name in variants if name != next(iter(variants))]
    return max(shifted, key=lambda name: abs(_accuracy(variants[name][1]) - _accuracy(variants[name][2])))


def variants_table(variants: Variants) -> tuple[str, dict[str, Any]]:
    """One row per held-out set: each arm's strict accuracy, its drop from the first set's (in distribution) and its
    blank-image accuracy, then McNemar's test of GRPO against the control on that set's images."""
    baseline = next(iter(variants.values()))
    labels = [model.label for model in baseline]
    lines = [
        "| held-out set | " + " | ".join(labels) + " | GRPO vs control (McNemar) |",
        "|---" * (len(labels) + 2) + "|",
    ]
    facts: dict[str, Any] = {}
    for variant, models in variants.items():
        cells = []
        for model, base in zip(models, baseline, strict=True):
            drop = 100 * (_accuracy(model) - _accuracy(base))
            shift = "" if model is base else f" ({drop:+.1f} pp)"
            cells.append(f"{100 * _accuracy(model):.1f}%{shift}; blank {100 * _accuracy(model, blank=True):.1f}%")
        test = mcnemar_exact(models[1].greedy["records"], models[2].greedy["records"])
        cells.append(f"{test['b']} vs {test['c']}, p = {test['p_value']:.3g}")
        lines.append(f"| {variant} (n = {models[0].greedy['summary']['n']}) | " + " | ".join(cells) + " |")
        facts[variant] = {m.label: _accuracy(m) for m in models} | {"p_grpo_vs_control": test["p_value"]}
    return "\n".join(lines), facts


def plot_variants(experiment: Experiment, variants: Variants, path: Path) -> None:
    """Bars: each arm's strict accuracy per held-out set, its blank-image accuracy as a black tick on its bar."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    figure = Figure(figsize=(10, 4.8))
    axis = figure.subplots()
    labels = [model.label for model in next(iter(variants.values()))]
    width = 0.8 / len(labels)
    for index, label in enumerate(labels):
        xs = [x + (index - (len(labels) - 1) / 2) * width for x in range(len(variants))]
        values = [_accuracy(models[index]) for models in variants.values()]
        drawn = axis.bar(xs, values, width=width, label=label)
        axis.bar_label(drawn, labels=[f"{100 * v:.0f}%" for v in values], fontsize=8, padding=1)
        blanks = [_accuracy(models[index], blank=True) for models in variants.values()]
        axis.hlines(
            blanks,
            [x - width / 2 for x in xs],
            [x + width / 2 for x in xs],
            colors="black",
            linewidth=2,
            label="same model, blank image" if index == 0 else None,
        )
    names = [f"{name}\n(n = {models[0].greedy['summary']['n']})" for name, models in variants.items()]
    axis.set_xticks(range(len(variants)), names, fontsize=9)
    axis.set(title=f"{experiment.title}\ngreedy, strict accuracy per held-out set", ylabel="strict accuracy")
    axis.set(ylim=(0, 1.15), yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0])
    axis.yaxis.set_major_formatter(PercentFormatter(1.0))
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8, loc="upper center", ncol=len(labels) + 1)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def generalization_section(
    experiment: Experiment, runs: Runs, results_dir: Path, quick: bool, clock: StageClock
) -> tuple[str, dict[str, Any]]:
    """The experiment's report section (its tables, the compute curve on the separating set) and its PNGs."""
    variants = evaluate_variants(experiment, runs, results_dir, quick, clock)
    table, facts = variants_table(variants)
    (results_dir / f"{experiment.results_prefix}variants.json").write_text(json.dumps(facts, indent=1) + "\n")
    png = results_dir / f"{experiment.results_prefix}variants.png"
    plot_variants(experiment, variants, png)
    chosen = separating_variant(variants)
    flags = dict(experiment.held_out_variants)[chosen]
    with clock.stage(f"{experiment.title}: every checkpoint on {chosen} against compute"):
        on_chosen = dataclasses.replace(experiment, title=f"{experiment.title}: {chosen}")
        curves, _ = compute_curve(
            on_chosen, runs, variants[chosen], results_dir, [*(QUICK_EVAL if quick else []), *flags]
        )
        curve_png = results_dir / f"{experiment.results_prefix}curve.png"
        plot_curve(on_chosen, curves, variants[chosen][0].greedy["summary"]["n"], curve_png)
    caption = (
        f"Strict accuracy per held-out set (drop from in distribution; the blank-image control), {png.name}:\n\n{table}"
        f"\n\nOn {chosen}, where GRPO and the control differ most, held-out strict accuracy against compute, both "
        f"arms from the warm start ({curve_png.name}):\n\n{curve_table(curves)}"
    )
    return f"## {experiment.title}\n\n{caption}", facts
