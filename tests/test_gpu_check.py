"""`benchmarks/gpu_check.py`, the GPU check of this round, run here as its dry run: every part at replica size on the
CPU through the same stage code (GeoQA evaluation through `eval/evaluate.py`, one GRPO step of the seed's recipe
through `recipes/train.py` with and without shared copies, the memory plan of each phase), its JSON and markdown
table read back; the real-size models have the parameters the memory plan counts for the shipped Hub configs."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_script
from tensorboard.backend.event_processing import event_accumulator

from vision_grpo.models.gated_deltanet import gated_deltanet_path
from vision_grpo.plan.estimate import SHIPPED_CONFIGS, parameter_counts

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check_parts  # noqa: E402

PHASES = ("generation", "train", "optimizer")


def table_rows(markdown: str) -> list[list[str]]:
    """The table's body rows, split on unescaped `|`."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")][2:]  # after header and rule
    return [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


def parsed(cell: str) -> Any:
    """A cell as a value: `-` is no figure, a number a float, anything else the text."""
    if cell == "-":
        return None
    try:
        return float(cell)
    except ValueError:
        return cell


@pytest.mark.slow
def test_the_dry_run_writes_every_part_to_one_json_and_one_table(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["benchmarks/gpu_check.py", "--dry-run", "--out", str(out), "--workdir", str(work)]
    run_script([*args, "--eval-items", "3", "--eval-batch", "2", "--max-new-tokens", "4"], timeout=600)
    result = json.loads((out / "gpu_check.json").read_text())
    entries = result["entries"]

    # The table is the JSON's entries, row for row and cell for cell.
    rows = table_rows((out / "gpu_check.md").read_text())
    assert len(rows) == len(entries) > 0
    for row, entry in zip(rows, entries, strict=True):
        assert [parsed(cell) for cell in row] == [entry[key] for key in gpu_check_parts.TABLE_COLUMNS], row

    # Every part is there: each step variant's three phases, the comparisons, both evaluation backends.
    figures = {(e["part"], e["figure"]) for e in entries}
    labels = ("HF generation, copies shared", "vLLM colocate", "HF generation, every copy encoded and prefilled")
    for label in (*labels, "HF generation, TRL's training pass (each row its prompt, padded)"):
        assert {(f"memory, seed step, {label}", f"{phase} peak GiB") for phase in PHASES} <= figures
    for backend in ("hf", "vllm"):
        assert ("GeoQA evaluation, qwen3.5-4b, " + backend, "samples/s vs the seed's") in figures
    assert ("memory, GeoQA evaluation, qwen3.5-4b, hf", "evaluation peak GiB") in figures
    assert ("vLLM colocate vs HF generation, seed step", "s/step, vLLM / HF") in figures
    assert ("vision sharing, seed step", "s/step, every copy / shared") in figures
    assert ("training pass, seed step", "s/step, TRL's pass / packed") in figures

    # A part without figures says why, in its entries and in the parts record; here the vLLM parts are skipped.
    for e in entries:
        assert (e["ratio"] is None) == (e["measured"] is None or e["reference"] is None), e
        if e["measured"] is None:
            assert re.match(r"skipped \(\S+\): \S", e["note"]) or "no GPU" in e["note"], e
    for name, part in result["parts"].items():
        assert part["skipped"] is None or part["skipped"].strip(), name
        assert part["skipped"] is not None or part["wall_s"] > 0, name
    vllm_reason = result["parts"]["train_vllm"]["skipped"]
    assert vllm_reason == result["parts"]["eval_vllm:qwen3.5-4b"]["skipped"]
    if importlib.util.find_spec("vllm") is None:
        assert "vllm is not importable" in vllm_reason
    assert all(
        result["parts"][key]["skipped"] is None
        for key in ("eval_hf:qwen3.5-4b", "train_hf", "train_hf_trl_pass", "train_hf_per_copy")
    )

    # No GPU: memory is the plan's figure only, never a measured one; each phase hook ran once (one micro-batch).
    memory = [e for e in entries if e["part"].startswith("memory") and e["reference"] is not None]
    assert len(memory) == 3 * len(PHASES) + 1
    assert all(e["measured"] is None and e["reference"] > 0 and "no GPU" in e["note"] for e in memory)
    step = result["seed_step"]
    for key in ("train_hf", "train_hf_trl_pass", "train_hf_per_copy"):
        assert step[key]["phase_calls"] == dict.fromkeys(PHASES, 1)
        plan = step[key]["plan_gib"]
        assert plan["train"] > plan["optimizer"] > 0  # the model states are part of the training phase
    # Sharing the copies shrinks the plan's generation phase: the overrides reached the plan.
    assert step["train_hf_per_copy"]["plan_gib"]["generation"] > step["train_hf"]["plan_gib"]["generation"]
    assert step["train_hf_trl_pass"]["plan_gib"]["train"] > step["train_hf"]["plan_gib"]["train"]  # and TRL's pass

    # What it reports is what the evaluation wrote and what the training runs logged, read back here on their own.
    evaluation = result["evaluation"]["qwen3.5-4b"]["hf"]
    written = json.loads((work / "qwen3.5-4b-hf.json").read_text())
    assert (evaluation["items"], evaluation["batch"], evaluation["device"]) == (3, 2, "cpu")
    assert written["metadata"]["max_new_tokens"] == 4 and 0 < evaluation["mean_completion_tokens"] <= 4
    for key in ("samples_per_s", "mean_completion_tokens", "hit_limit_rate"):
        assert evaluation[key] == written["summary"][key], key
    seed_row = next(e for e in entries if e["part"] == "GeoQA evaluation, qwen3.5-4b, hf")
    assert seed_row["reference"] == 2.2 and seed_row["measured"] == pytest.approx(evaluation["samples_per_s"], 1e-3)
    for key in ("train_hf", "train_hf_per_copy"):
        events = event_accumulator.EventAccumulator(str(work / key / "check"))
        events.Reload()
        (step_time,) = events.Scalars("train/step_time")
        assert step[key]["s_per_step"] == pytest.approx(step_time.value, rel=1e-6)
    assert result["models"]["qwen3.5-4b"]["gated_deltanet_path"] == gated_deltanet_path()  # "torch" here
    for name, published in (("qwen2.5-vl-3b", "Qwen--Qwen2.5-VL-3B-Instruct"), ("qwen3.5-4b", "Qwen--Qwen3.5-4B")):
        assert result["models"][name]["parameters"] == shipped_parameters(published), name  # the plan's model


def test_a_part_with_no_time_left_is_skipped_with_the_reason() -> None:
    budget = gpu_check_parts.Budget(5)

    def never(cap: float) -> tuple[dict, gpu_check_parts.PartRun]:
        raise AssertionError("a part with 5 s left of the budget and a 60 s cap must not start")

    assert budget.run("train_hf", 60, never) == {}
    assert budget.reason("train_hf").endswith("s left of the time budget")
    for key in ("train_hf_trl_pass", "train_hf_per_copy", "train_vllm"):
        budget.skip(key, 60, "not wanted here")
    (row,) = [e for e in gpu_check_parts.step_entries({}, {"train_hf": "x"}, budget) if e["figure"] == "train peak GiB"]
    assert row["measured"] is None and row["note"].startswith("skipped (train_hf): ")


def shipped_parameters(name: str) -> int:
    """The parameters the memory plan counts (on the meta device) for its shipped copy of a Hub config."""
    from transformers import AutoConfig

    return parameter_counts(AutoConfig.from_pretrained(SHIPPED_CONFIGS / f"{name}.json"), 0, False, None)["total"]
