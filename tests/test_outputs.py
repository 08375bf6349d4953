"""An output is never one of the files its command reads, and `--overwrite` replaces only an earlier result: each
refused before any model loads (`build_evaluator` is made to fail if reached), the file or folder left as it was."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import entry_point

from vision_grpo.evaluation import evaluate, pass_at_k, results
from vision_grpo.evaluation.adapters import AdapterMismatch
from vision_grpo.run.outputs import OutputIsInput, check_outputs_are_not_inputs

SHAPES_RECIPE = "recipes/shapes/tiny_cpu.yaml"
RESULT = {"summary": {"n": 0}, "metadata": {}, "records": []}


@pytest.fixture(autouse=True)
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every refusal here must come before the model loads."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(evaluate, "build_evaluator", refuse)
    monkeypatch.setattr(pass_at_k, "build_evaluator", refuse)


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    return Path(shutil.copy(SHAPES_RECIPE, tmp_path / "x.yaml"))


@pytest.mark.parametrize("entry", [evaluate.main, pass_at_k.main], ids=["evaluate", "pass_at_k"])
@pytest.mark.parametrize("how", ["same path", "symbolic link", "hard link"])
def test_an_output_that_is_the_recipe_is_refused_even_with_overwrite(entry, how: str, recipe: Path) -> None:
    before = recipe.read_bytes()
    output = {"same path": recipe, "symbolic link": recipe.with_name("l.yaml"), "hard link": recipe.with_name("h")}[how]
    if how == "symbolic link":
        output.symlink_to(recipe.name)
    elif how == "hard link":
        os.link(recipe, output)
    with pytest.raises(OutputIsInput, match=rf"--output {output} is the recipe \(--config\) .*x.yaml.*choose another"):
        entry(["--config", str(recipe), "--output", str(output), "--overwrite"])
    assert recipe.read_bytes() == before


def test_an_existing_file_inside_an_input_folder_is_refused(tmp_path: Path) -> None:
    adapter = tmp_path / "checkpoint-2"
    adapter.mkdir()
    (adapter / "trainer_state.json").write_text("{}")
    with pytest.raises(OutputIsInput, match=r"is inside the adapter \(--adapter\) .*checkpoint-2"):
        check_outputs_are_not_inputs("--output", [adapter / "trainer_state.json"], {"the adapter (--adapter)": adapter})
    # a new file beside the adapter's own, or anywhere else, is fine; unset and missing inputs are skipped
    check_outputs_are_not_inputs("--output", [adapter / "eval.json"], {"the adapter (--adapter)": adapter})
    check_outputs_are_not_inputs("--output", [tmp_path / "r.json"], {"a": None, "b": tmp_path / "gone"})


def test_an_output_folder_is_refused_before_the_evaluation_even_with_overwrite(recipe: Path, tmp_path: Path) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    with pytest.raises(results.OutputConflict, match=r"--output .*results is a folder: name the result file, e.g."):
        evaluate.main(["--config", str(recipe), "--output", str(folder), "--overwrite"])


@pytest.mark.parametrize("content", ["notes\n", "{not json", '{"a": 1}'], ids=["text", "broken json", "other json"])
def test_overwrite_replaces_only_an_earlier_result(content: str, recipe: Path, tmp_path: Path) -> None:
    output = tmp_path / "notes.txt"
    output.write_text(content)
    with pytest.raises(
        results.OutputConflict, match=r"exists and is not a result of an evaluation \(.*\): --overwrite"
    ):
        evaluate.main(["--config", str(recipe), "--output", str(output), "--overwrite"])
    assert output.read_text() == content


def test_a_result_is_still_replaceable(tmp_path: Path) -> None:
    output = tmp_path / "eval.json"
    output.write_text(json.dumps(RESULT))
    results.check_replaceable(output)


def test_the_adapters_weights_file_as_adapter_points_to_its_folder(recipe: Path, tmp_path: Path) -> None:
    """Before: `adapter folder <file> does not exist`, about a file that does exist."""
    weights = tmp_path / "checkpoint-2" / "adapter_model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"")
    message = (
        rf"--adapter {weights} is a file: an adapter is the folder that holds .*; pass --adapter {weights.parent}$"
    )
    with pytest.raises(AdapterMismatch, match=message):
        evaluate.main(["--config", str(recipe), "--adapter", str(weights), "--output", str(tmp_path / "r.json")])


def test_compare_refuses_to_write_its_report_over_a_result_it_reads(tmp_path: Path) -> None:
    compare = entry_point("eval/compare.py")
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for path in (first, second):
        path.write_text(json.dumps(RESULT))
    for flag in ("--output", "--plot"):
        with pytest.raises(OutputIsInput, match=rf"{flag} .*b.json is result file 2"):
            compare.main([str(first), str(second), flag, str(second)])
    assert json.loads(second.read_text()) == RESULT
