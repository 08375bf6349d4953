"""Experiments 3, 4 and 5 end to end at toy size, with one seed (43) into one runs folder and one results folder, as
`make experiment-seeds` runs a seed. Experiment 3 trains the warm start and both arms; Experiment 4 reuses its warm
start and GRPO arm and trains only its dynamic-sampling arm; Experiment 5 reuses all three and only evaluates. Each
section joins a report other commands wrote into the same folder; runs, result files, sections and figures are named
by the seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_script

from vision_grpo.demo.experiments import EXPERIMENTS
from vision_grpo.demo.stages import measured_passes, tokens_at

pytestmark = pytest.mark.slow

PERCEPTION, DYNAMIC, GENERALIZATION = (e for e in EXPERIMENTS if e.key in ("perception", "dynamic", "generalization"))
PNG = b"\x89PNG\r\n\x1a\n"
WARM, GRPO = "tiny_sft_perception/demo-seed43-perception", "tiny_grpo_perception/demo-seed43-perception"
CONTROL = f"{WARM}-control"


@pytest.fixture(scope="module")
def experiments(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(the runs' shapes folder, the results folder, each experiment's stdout), run one after the other."""
    tmp = tmp_path_factory.mktemp("experiments")
    runs, results = tmp / "runs", tmp / "results"
    (results / "sections").mkdir(parents=True)
    (results / "sections" / "format.md").write_text("## Experiment 1: written by an earlier make demo\n")
    out = {}
    for experiment in (PERCEPTION, DYNAMIC, GENERALIZATION):
        command = ["-m", "vision_grpo.demo", "--quick", "--experiments", experiment.key, "--seed", "43"]
        command += ["--runs-dir", str(runs), "--results-dir", str(results)]
        out[experiment.key] = run_script(command, timeout=900).stdout
    return runs / "shapes", results, out


def reused(stdout: str) -> set[str]:
    """The run folders a demo command reused (finished earlier), as `<recipe>/<run name>`."""
    lines = [line.split()[1] for line in stdout.splitlines() if line.startswith("reusing ")]
    return {"/".join(Path(line).parts[-2:]) for line in lines}


def test_perception_compares_grpo_with_the_control_at_equal_compute(experiments) -> None:
    runs, results, out = experiments
    assert reused(out["perception"]) == set()
    report = (results / "report.md").read_text()
    assert report.index("## Experiment 1: written by an earlier make demo") < report.index(f"## {PERCEPTION.title}")
    assert f"## {PERCEPTION.title} (seed 43)" in report
    assert "McNemar exact test on strict accuracy, SFT control (more SFT) → after GRPO" in report
    assert "strict accuracy with shuffled images (another image's)" in report
    for png in ("seed43_perception.png", "seed43_perception_curve.png"):
        assert (results / png).read_bytes()[:8] == PNG
    assert not (results / "perception.png").exists()  # seeds share the folder (make experiment-seeds): a name each
    # The curve: both arms from the warm start to their matched budgets, every point a held-out evaluation.
    curves = json.loads((results / "seed43_perception_curve.json").read_text())
    grpo, control = curves["after GRPO"], curves["SFT control (more SFT)"]
    warm = json.loads((results / "seed43_perception_warm_start.json").read_text())["summary"]["accuracy"]
    assert grpo[0] == control[0] == {"step": 0, "token_passes": 0, "accuracy": warm}
    control_steps = json.loads((runs / CONTROL / "manifest.json").read_text())["global_step"]
    assert len(control) == 1 + control_steps  # quick: a checkpoint every step
    per_step = control[-1]["token_passes"] / control[-1]["step"]
    assert abs(control[-1]["token_passes"] - grpo[-1]["token_passes"]) <= per_step
    final = json.loads((results / "seed43_perception_grpo.json").read_text())["summary"]["accuracy"]
    assert grpo[-1]["accuracy"] == final
    for stage in (WARM, GRPO, CONTROL):
        assert "seed: 43" in (runs / stage / "recipe.yaml").read_text().splitlines()


def test_dynamic_sampling_reuses_the_warm_start_and_compares_the_arms_by_their_compute(experiments) -> None:
    runs, results, out = experiments
    assert reused(out["dynamic"]) == {WARM, GRPO}
    report = (results / "report.md").read_text()
    assert f"## {DYNAMIC.title} (seed 43)" in report
    assert "McNemar exact test on strict accuracy, GRPO + dynamic sampling → after GRPO" in report
    assert "token-passes: generated tokens + 3 x positions trained" in report
    assert "At equal compute, McNemar" in report or "no test at equal compute" in report
    for png in ("seed43_dynamic.png", "seed43_dynamic_curve.png"):
        assert (results / png).read_bytes()[:8] == PNG
    curves = json.loads((results / "seed43_dynamic_curve.json").read_text())
    plain, sampled = curves["after GRPO"], curves["GRPO + dynamic sampling"]
    variant = runs / f"{GRPO}-dynamic"
    assert "dynamic_sampling_rounds: 3" in (variant / "recipe.yaml").read_text()
    assert [p["step"] for p in sampled] == [0, 1, 2]  # quick: a checkpoint every step
    # Compute as measured: every generated token once, every trained position three times; never less than the
    # generated tokens alone, and the same count the curve shows
    assert sampled[-1]["token_passes"] == measured_passes(variant, 2) >= tokens_at(variant, 2) > 0
    assert plain[0] == sampled[0] and plain[-1]["step"] == 2


def test_generalization_evaluates_the_same_arms_on_each_held_out_set(experiments) -> None:
    _, results, out = experiments
    assert reused(out["generalization"]) == {WARM, GRPO, CONTROL}  # nothing trained again
    report = (results / "report.md").read_text()
    assert f"## {GENERALIZATION.title} (seed 43)" in report and "GRPO vs control (McNemar)" in report
    assert (results / "sections" / "generalization-seed43.md").is_file()
    prefix = results / "seed43_generalization_"
    for png in ("variants.png", "curve.png"):
        assert Path(f"{prefix}{png}").read_bytes()[:8] == PNG
    facts = json.loads(Path(f"{prefix}variants.json").read_text())
    assert list(facts) == [name for name, _ in GENERALIZATION.held_out_variants]
    # Every set's results are the arms' evaluations on images drawn with that set's keys and seed.
    colour = json.loads(Path(f"{prefix}unseen_colour_grpo.json").read_text())
    generator = colour["metadata"]["dataset"]["generator"]
    assert generator["fill_color"] == "orange" and colour["metadata"]["dataset"]["eval"]["seed"] == 21
    in_distribution = json.loads(Path(f"{prefix}in_distribution_grpo.json").read_text())
    assert facts["in distribution"]["after GRPO"] == in_distribution["summary"]["accuracy"]
