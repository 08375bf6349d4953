"""The spread over seeds (`python -m vision_grpo.demo.seeds`): read from the result files each seed's demo wrote,
one column per seed, mean and range, McNemar per seed, and a claim only where it holds on every seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vision_grpo.demo.experiments import EXPERIMENTS
from vision_grpo.demo.seeds import ARMS, main

(PERCEPTION,) = [e for e in EXPERIMENTS if e.key == "perception"]


def _write(results: Path, prefix: str, right: dict[str, list[bool]]) -> None:
    for arm, answers in right.items():
        records = [{"id": str(i), "correct": ok} for i, ok in enumerate(answers)]
        summary = {"accuracy": sum(answers) / len(answers), "n": len(answers)}
        (results / f"{prefix}{arm}.json").write_text(json.dumps({"summary": summary, "records": records}))


def test_a_claim_is_made_only_where_it_holds_on_every_seed(tmp_path: Path) -> None:
    warm = [True] * 5 + [False] * 15
    control = [True] * 14 + [False] * 6
    _write(tmp_path, "perception_", {"warm_start": warm, "grpo": [False] * 20, "sft_control": control})
    _write(
        tmp_path, "seed43_perception_", {"warm_start": warm, "grpo": [True] * 2 + [False] * 18, "sft_control": control}
    )
    main(["--seeds", "42", "43", "--experiments", "perception", "--results-dir", str(tmp_path)])
    section = (tmp_path / "sections" / "perception-seeds.md").read_text()
    assert f"## {PERCEPTION.title}: 2 seeds" in section
    assert "| held out, after GRPO | 0.0% | 10.0% | 5.0% | 0.0-10.0% |" in section
    assert "| held out, GRPO vs control (McNemar) | 0 vs 14, p = 0.00012 | 0 vs 12, p = 0.00049 | | |" in section
    assert "**control ahead on every seed**" in section
    assert section in (tmp_path / "report.md").read_text()
    # One seed the other way round: no claim
    _write(tmp_path, "seed43_perception_", {"warm_start": warm, "grpo": [True] * 20, "sft_control": control})
    main(["--seeds", "42", "43", "--experiments", "perception", "--results-dir", str(tmp_path)])
    assert "no claim (it does not hold on every seed)" in (tmp_path / "sections" / "perception-seeds.md").read_text()
    assert set(ARMS) == {"warm_start", "grpo", "sft_control"}


def test_a_missing_seed_says_which_command_makes_it(tmp_path: Path) -> None:
    with pytest.raises(
        SystemExit,
        match=r"/perception_warm_start.json is missing: run `python -m vision_grpo.demo "
        r"--experiments perception` first",
    ):
        main(["--seeds", "42", "44", "--experiments", "perception", "--results-dir", str(tmp_path)])
    _write(tmp_path, "perception_", dict.fromkeys(ARMS, [True]))
    with pytest.raises(SystemExit, match=r"seed44_perception_warm_start.json is missing: run .*perception --seed 44`"):
        main(["--seeds", "42", "44", "--experiments", "perception", "--results-dir", str(tmp_path)])
