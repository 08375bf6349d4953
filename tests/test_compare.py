"""`eval/compare.py`: McNemar's exact test, the comparison table, the grounding check, refusal of different items
and of a file given twice, the command line (markdown and PNG, an earlier comparison replaced only with
`--overwrite`) and a chart whose run names stay readable. Result files here are built by the evaluator's own
scoring and summary from chosen completions, so every expected number can be counted by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import entry_point, run_script
from hypothesis import given
from hypothesis import strategies as st
from matplotlib.backends.backend_agg import FigureCanvasAgg

from vision_grpo.data import task_shapes
from vision_grpo.evaluation.comparison import (
    OutputExists,
    check_same_items,
    comparison_table,
    grounding_table,
    load_result,
    plot_comparison,
)
from vision_grpo.evaluation.scoring import summarize
from vision_grpo.evaluation.statistics import ItemMismatch, ResultError, exact_binomial_p, mcnemar_exact

main = entry_point("eval/compare.py").main

GOLD = [1, 2, 3, 4, 5, 1, 2, 3]
SHAPES = ["circles", "squares", "triangles", "circles", "squares", "triangles", "circles", "squares"]


def make_result(answers: list[int | None], image_control: str = "none", gold: list[int] = GOLD) -> dict:
    """A result as `eval/evaluate.py` writes it: `None` is an answer without a box that ran into the token limit."""
    records = []
    for i, (answer, count, shape) in enumerate(zip(answers, gold, SHAPES, strict=True)):
        text = "no box here" if answer is None else f"I count them. \\boxed{{{answer}}}"
        records.append(
            {
                "id": f"2-{i}",
                **task_shapes.score({"answer": count, "shape": shape}, text),
                "completion_tokens": 24 if answer is None else 8,
                "hit_limit": answer is None,
                "text": text,
                "rewards": {"count_correct": float(answer == count)},
            }
        )
    summary = {**summarize(records), "samples_per_s": 4.0, "total_seconds": 2.0}
    metadata = {"model": "tiny", "adapter": None, "max_new_tokens": 24, "image_control": image_control}
    return {"summary": summary, "metadata": metadata, "records": records}


BASE = make_result([1, 2, None, None, 1, 1, None, 2])  # right: items 0, 1, 5 -> 3/8; 5 formatted
TRAINED = make_result([1, 2, 3, 4, 5, 2, 2, None])  # right: 0-4, 6 -> 6/8; 7 formatted


def test_exact_binomial_p_known_values() -> None:
    assert exact_binomial_p(0, 0) == 1.0
    assert exact_binomial_p(0, 5) == 2 / 32
    assert exact_binomial_p(3, 12) == 2 * (1 + 15 + 105 + 455) / 2**15  # 0.0352, the textbook example
    assert exact_binomial_p(5, 5) == 1.0  # capped: doubling the middle would exceed 1
    assert 0.0 <= exact_binomial_p(0, 2000) < 1e-300  # large n: no float overflow


@given(st.integers(0, 60), st.integers(0, 60))
def test_exact_binomial_p_is_symmetric_and_shrinks_with_the_gap(b: int, c: int) -> None:
    p = exact_binomial_p(b, c)
    assert 0.0 < p <= 1.0 and p == exact_binomial_p(c, b)
    if b + 1 <= c - 1:  # the same disagreements split less evenly: stronger evidence, smaller p
        assert exact_binomial_p(b, c) <= exact_binomial_p(b + 1, c - 1)


def test_mcnemar_counts_discordant_items() -> None:
    test = mcnemar_exact(BASE["records"], TRAINED["records"])
    # Only BASE right: item 5 (1 vs 2). Only TRAINED right: items 2, 3, 4, 6.
    assert (test["b"], test["c"]) == (1, 4)
    assert test["p_value"] == pytest.approx(2 * (1 + 5) / 32)
    reverse = mcnemar_exact(TRAINED["records"], BASE["records"])
    assert (reverse["b"], reverse["c"], reverse["p_value"]) == (4, 1, test["p_value"])


def test_mcnemar_refuses_other_items() -> None:
    with pytest.raises(ItemMismatch):
        mcnemar_exact(BASE["records"], TRAINED["records"][:-1])
    with pytest.raises(ItemMismatch):
        mcnemar_exact(BASE["records"], TRAINED["records"] + TRAINED["records"][:1])


def test_different_item_sets_are_refused_clearly() -> None:
    shorter = {**TRAINED, "records": TRAINED["records"][:6]}
    with pytest.raises(ItemMismatch, match=r"different items: 2 only in base .*'2-6'"):
        check_same_items([BASE, shorter], ["base", "short"])
    other_data = make_result([1, 2, 3, 4, 5, 2, 2, None], gold=[2, 2, 3, 4, 5, 1, 2, 3])
    with pytest.raises(ItemMismatch, match="different gold answers.*2-0"):
        check_same_items([BASE, other_data], ["base", "other"])


def test_comparison_table_rows() -> None:
    table = comparison_table([BASE, TRAINED], ["base", "step100"])
    lines = table.splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in lines[2:]}
    column = {name: header.index(name) for name in header}
    trained = rows["step100"]
    assert trained[column["Accuracy"]] == "75.0%" and rows["base"][column["Accuracy"]] == "37.5%"
    assert trained[column["Δ acc. (pp)"]] == "+37.5"
    assert trained[column["Format rate"]] == "87.5%" and trained[column["Δ format (pp)"]] == "+25.0"
    assert rows["base"][column["Acc. among formatted"]] == "3/5 = 60.0%"
    assert trained[column["Acc. among formatted"]] == "6/7 = 85.7%"
    assert rows["base"][column["Unparsed (hit limit)"]] == "3 (3)"
    assert trained[column["Mean tokens (all / formatted)"]] == f"{(7 * 8 + 24) / 8:.1f} / 8.0"
    assert trained[column["Samples/s"]] == "4.00" and trained[column["Total time"]] == "2.0 s"


def test_grounding_drop_pairs_a_control_with_the_same_models_real_images() -> None:
    blank = make_result([1, 1, 1, 1, 1, 1, 1, 1], image_control="blank")  # always "1": right on items 0 and 5
    table = grounding_table([TRAINED, blank], ["trained", "trained-blank"])
    row = [cell.strip() for cell in table.splitlines()[2].strip("|").split("|")]
    assert row[:6] == ["trained-blank", "blank", "trained", "75.0%", "25.0%", "+50.0"]
    assert row[6] == "0.219"  # only real images right: items 1-4, 6; only blank right: item 5 -> 2 * 7 / 64
    other_model = {**blank, "metadata": {**blank["metadata"], "adapter": "runs/x/checkpoint-2"}}
    unpaired = grounding_table([TRAINED, other_model], ["trained", "other-blank"])
    assert "| other-blank | blank | – |" in unpaired
    assert grounding_table([BASE, TRAINED], ["base", "trained"]) is None


def test_plot_bars_are_the_files_numbers(tmp_path: Path) -> None:
    figure = plot_comparison([BASE, TRAINED], ["base", "trained"], tmp_path / "compare.png")
    heights = sorted(round(patch.get_height(), 6) for patch in figure.axes[0].patches)
    assert heights == sorted([37.5, 75.0, 62.5, 87.5])
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_writes_report_and_plot(tmp_path: Path) -> None:
    paths = []
    for name, result in (("base", BASE), ("step100", TRAINED)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    markdown = main([*map(str, paths), "--plot", str(tmp_path / "c.png"), "--output", str(tmp_path / "c.md")])
    assert (tmp_path / "c.md").read_text() == markdown
    assert "| step100 | 8 | 75.0% | +37.5 |" in markdown
    assert "## Paired test against base" in markdown and "## Accuracy by true count" in markdown
    assert "## Grounding check" not in markdown  # no control run given
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_command_line_error_for_different_items_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(BASE))
    records = TRAINED["records"][:3]
    (tmp_path / "b.json").write_text(json.dumps({"summary": summarize(records), "records": records}))
    process = run_script(["eval/compare.py", str(tmp_path / "a.json"), str(tmp_path / "b.json")], check=False)
    assert process.returncode != 0
    assert "error: a and b hold different items" in process.stderr and "Traceback" not in process.stderr


def test_files_that_are_not_results_are_refused(tmp_path: Path) -> None:
    (tmp_path / "eval.json.partial.jsonl").write_text('{"metadata": {}}\n{"id": "2-0"}\n')
    with pytest.raises(ResultError, match="cannot read result file"):
        load_result(tmp_path / "eval.json.partial.jsonl")
    (tmp_path / "summary.json").write_text(json.dumps(BASE["summary"]))
    with pytest.raises(ResultError, match="not an evaluation result"):
        load_result(tmp_path / "summary.json")


def test_a_result_whose_summary_disagrees_with_its_records_is_refused_naming_the_file(tmp_path: Path) -> None:
    """The issue's case: `summary.accuracy` edited to 0.92 showed 92.0% in the table beside McNemar read from the
    records."""
    (tmp_path / "base.json").write_text(json.dumps(BASE))
    edited = {**TRAINED, "summary": {**TRAINED["summary"], "accuracy": 0.92}}
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    with pytest.raises(
        ResultError,
        match=r"edited.json: the summary disagrees with the records \(summary.accuracy is "
        r"0.92, its records give 0.75\)",
    ):
        main([str(tmp_path / "base.json"), str(tmp_path / "edited.json"), "--output", str(tmp_path / "c.md")])
    assert not (tmp_path / "c.md").exists()


def write_results(folder: Path) -> list[str]:
    """BASE and TRAINED as result files `base.json` and `step100.json` in `folder`."""
    paths = []
    for name, result in (("base", BASE), ("step100", TRAINED)):
        paths.append(folder / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    return [str(path) for path in paths]


def test_an_earlier_comparison_is_replaced_only_with_overwrite(tmp_path: Path, monkeypatch) -> None:
    """The chart follows `--output` (before: always `results/eval_compare.png`, so a second comparison with its own
    `--output` replaced the first one's chart), and neither file is replaced without `--overwrite`."""
    monkeypatch.chdir(tmp_path)
    results = write_results(tmp_path)
    main([*results, "--output", "first.md"])
    main([*results, "--output", "second.md"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".json") == [
        "first.md",
        "first.png",
        "second.md",
        "second.png",
    ]
    report, chart = (tmp_path / "first.md").read_bytes(), (tmp_path / "first.png").read_bytes()
    with pytest.raises(OutputExists, match=r"^--output first.md holds an earlier comparison: pass --overwrite"):
        main([*results, "--output", "first.md"])
    (tmp_path / "first.md").unlink()
    with pytest.raises(OutputExists, match=r"the chart first.png \(--output's name with .png\) holds an earlier"):
        main([*results, "--output", "first.md"])
    with pytest.raises(OutputExists, match=r"--plot second.png holds an earlier comparison.*another --plot"):
        main([*results, "--output", "third.md", "--plot", "second.png"])
    assert (tmp_path / "first.png").read_bytes() == chart and not (tmp_path / "third.md").exists()
    main([*results, "--output", "first.md", "--overwrite"])
    assert (tmp_path / "first.md").read_bytes() == report


def test_a_file_of_another_kind_is_not_replaced_even_with_overwrite(tmp_path: Path) -> None:
    results = write_results(tmp_path)
    (tmp_path / "notes.md").write_text("# my notes\n")
    with pytest.raises(OutputExists, match=r"notes.md exists and is not a report of eval/compare.py"):
        main([*results, "--output", str(tmp_path / "notes.md"), "--overwrite"])
    assert (tmp_path / "notes.md").read_text() == "# my notes\n" and not (tmp_path / "notes.png").exists()


def test_a_result_file_given_twice_is_refused_however_it_is_spelled(tmp_path: Path) -> None:
    """Compared with itself a run shows no change and McNemar's p = 1: a finding made of a typo."""
    base, step100 = write_results(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "latest.json").symlink_to(step100)
    spellings = [step100, str(tmp_path / "sub" / ".." / "step100.json"), str(tmp_path / "latest.json")]
    message = r"result files 2 and 3: .*step100.json (is given twice|and .* are one file); compared with itself"
    for again in spellings:
        with pytest.raises(ResultError, match=message):
            main([base, step100, again, "--output", str(tmp_path / "c.md")])
    assert not (tmp_path / "c.md").exists()


def test_five_long_run_names_stay_readable_under_the_bars(tmp_path: Path) -> None:
    """Result files named as runs are (`geoqa_qwen2.5vl_lora_r16_step100_eval`): the names under the bars were one
    line each and ran into one another. Each label must now lie clear of its neighbours, inside the figure."""
    names = [
        "geoqa_qwen2.5vl_3b_base_eval",
        "geoqa_qwen2.5vl_lora_r16_step100_eval",
        "geoqa_qwen2.5vl_lora_r16_step200_eval",
        "geoqa_qwen2.5vl_lora_r16_step300_blank_eval",
        "geoqa_qwen3.5_4b_lora_r32_lr1e-5_step400_eval",
    ]
    figure = plot_comparison([BASE, TRAINED, TRAINED, BASE, TRAINED], names, tmp_path / "five.png")
    renderer = FigureCanvasAgg(figure).get_renderer()  # the backend savefig drew with
    labels = figure.axes[0].get_xticklabels()
    assert [label.get_text().replace("\n", "") for label in labels] == names  # wrapped, nothing left out
    boxes = [label.get_window_extent(renderer) for label in labels]
    for left, right in zip(boxes, boxes[1:], strict=False):
        assert left.x1 < right.x0, "neighbouring run names overlap"
    page = figure.bbox
    assert all(page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 for box in boxes)
