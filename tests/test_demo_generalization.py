"""Experiment 5 (`make experiment-generalization`): Experiment 3's arms on held-out sets out of the training
distribution; the sets are recipe keys checked like any other, the table's arithmetic is the result files', and the
whole experiment runs end to end at toy size."""

from __future__ import annotations

from trl import GRPOConfig, ModelConfig

from vision_grpo.demo.experiments import EXPERIMENTS
from vision_grpo.demo.generalization import separating_variant, variants_table
from vision_grpo.demo.stages import Evaluated
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

(GENERALIZATION,) = [e for e in EXPERIMENTS if e.key == "generalization"]
(PERCEPTION,) = [e for e in EXPERIMENTS if e.key == "perception"]


def test_every_held_out_set_is_a_valid_recipe_with_a_seed_of_its_own() -> None:
    """Each set parses as the GRPO recipe with its flags, draws n = 300 images from a seed no other set (and not the
    training images) uses; Experiment 5 trains exactly Experiment 3's runs, so those are reused."""
    seeds = []
    for _, flags in GENERALIZATION.held_out_variants:
        argv = ["--config", GENERALIZATION.grpo_recipe, *flags, "--use_cpu", "true"]
        task_args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]
        assert task_args.shapes_eval_size == 300 and task_args.shapes_eval_seed != task_args.shapes_train_seed
        seeds.append(task_args.shapes_eval_seed)
    assert len(set(seeds)) == len(seeds) == 4
    same = ("sft_recipe", "grpo_recipe", "run_suffix", "sft_control", "compute_curve")
    assert all(getattr(GENERALIZATION, key) == getattr(PERCEPTION, key) for key in same)


def _model(label: str, right: list[bool], blank: float) -> Evaluated:
    records = [{"id": str(i), "correct": ok} for i, ok in enumerate(right)]
    greedy = {"summary": {"accuracy": sum(right) / len(right), "n": len(right)}, "records": records}
    return Evaluated(label, greedy, {"summary": {"accuracy": blank}}, {}, {}, "")


def test_the_table_reads_drops_blank_controls_and_the_paired_test_from_the_records() -> None:
    variants = {
        "in distribution": [
            _model("warm", [1, 0, 0, 0], 0.25),
            _model("grpo", [1, 1, 0, 0], 0.0),
            _model("sft", [1, 1, 1, 0], 0.5),
        ],
        "unseen colour": [
            _model("warm", [0, 0, 0, 0], 0.25),
            _model("grpo", [1, 1, 1, 0], 0.0),
            _model("sft", [0, 0, 0, 0], 0.5),
        ],
        "noise": [
            _model("warm", [1, 0, 0, 0], 0.25),
            _model("grpo", [1, 1, 0, 0], 0.0),
            _model("sft", [1, 1, 1, 1], 0.5),
        ],
    }
    table, facts = variants_table(variants)
    rows = table.splitlines()
    assert (
        rows[2]
        == "| in distribution (n = 4) | 25.0%; blank 25.0% | 50.0%; blank 0.0% | 75.0%; blank 50.0% | 0 vs 1, p = 1 |"
    )
    assert rows[3].startswith("| unseen colour (n = 4) | 0.0% (-25.0 pp); blank 25.0% | 75.0% (+25.0 pp); blank 0.0% |")
    assert rows[3].endswith("| 3 vs 0, p = 0.25 |")
    assert facts["unseen colour"]["grpo"] == 0.75 and separating_variant(variants) == "unseen colour"
