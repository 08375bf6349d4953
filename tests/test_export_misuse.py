"""`python -m vision_grpo.export` misused: each refusal names the flag or file and comes before the model loads
(`load_model` is made to fail if reached); a real export makes the folders above `--output` and leaves a folder
other accounts can read."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from conftest import FAMILY_MODELS
from lora_runs import lora_run

from vision_grpo.evaluation.adapters import AdapterMismatch
from vision_grpo.export import export_command as export_cli
from vision_grpo.export.checks import ExportError, hold_output
from vision_grpo.recipe.arguments import RecipeError

RECIPE = "recipes/shapes/tiny_cpu.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lora_run(tmp_path_factory.mktemp("export") / "run", FAMILY_MODELS[0], RECIPE)


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the export's arguments were checked")

    monkeypatch.setattr(export_cli, "load_model", refuse)


@pytest.mark.parametrize(
    "content, message",
    [(None, r"--eval .*r.json does not exist: pass the result file"), ("{oops", r"--eval .*r.json is not a result")],
    ids=["missing", "not json"],
)
def test_an_eval_file_that_is_missing_or_not_a_result_is_named(
    content: str | None, message: str, run: Path, tmp_path: Path, no_model: None
) -> None:
    result = tmp_path / "r.json"
    if content is not None:
        result.write_text(content)
    with pytest.raises(ExportError, match=message):
        export_cli.main(["--adapter", str(run), "--output", str(tmp_path / "out"), "--eval", str(result)])


@pytest.mark.parametrize("size", ["banana", "0GB", "5GiB"])
def test_a_shard_size_that_is_not_a_size_is_refused_naming_the_flag(
    size: str, run: Path, tmp_path: Path, no_model: None, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        export_cli.main(["--adapter", str(run), "--output", str(tmp_path / "out"), "--max_shard_size", size])
    assert f"argument --max_shard_size: '{size}' is not a" in capsys.readouterr().err


def test_a_folder_that_is_not_an_adapter_gets_the_evaluators_message(run: Path, tmp_path: Path, no_model: None) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "recipe.yaml").write_bytes((run / "recipe.yaml").read_bytes())
    with pytest.raises(AdapterMismatch, match=r"notes has no adapter_config.json and no adapter_model.safetensors"):
        export_cli.main(["--adapter", str(folder), "--output", str(tmp_path / "out")])


def test_the_adapters_weights_file_points_to_its_folder(run: Path, tmp_path: Path, no_model: None) -> None:
    weights = run / "adapter_model.safetensors"
    with pytest.raises(AdapterMismatch, match=rf"--adapter {weights} is a file: .*; pass --adapter {run}$"):
        export_cli.main(["--adapter", str(weights), "--output", str(tmp_path / "out")])


def test_an_output_that_is_a_symbolic_link_is_refused(run: Path, tmp_path: Path, no_model: None) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    with pytest.raises(ExportError, match=r"--output .*link is a symbolic link \(to target\).*the target folder"):
        export_cli.main(["--adapter", str(run), "--output", str(tmp_path / "link")])


def test_a_second_export_to_one_output_fails_at_once_naming_the_first(
    run: Path, tmp_path: Path, no_model: None
) -> None:
    output = tmp_path / "out"
    busy = rf"another export \(pid {os.getpid()}\) is writing .*out: wait"
    with hold_output(output), pytest.raises(ExportError, match=busy):
        export_cli.main(["--adapter", str(run), "--output", str(output)])


def test_a_config_that_does_not_exist_is_blamed_on_the_flag(run: Path, tmp_path: Path, no_model: None) -> None:
    """Before: "<adapter> has no recipe.yaml beside it", though the run has one and the flag named another file."""
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ExportError, match=rf"^--config {missing} does not exist: pass the recipe {run} was trained"):
        export_cli.main(["--adapter", str(run), "--output", str(tmp_path / "out"), "--config", str(missing)])
    with pytest.raises(RecipeError, match=rf"^recipe {tmp_path} is a folder, not a recipe file"):
        export_cli.main(["--adapter", str(run), "--output", str(tmp_path / "out"), "--config", str(tmp_path)])


def test_a_refused_export_removes_the_folders_it_made_for_its_output(run: Path, tmp_path: Path, no_model: None) -> None:
    with pytest.raises(AssertionError, match="the model was loaded"):  # refused once the folders were made
        export_cli.main(["--adapter", str(run), "--output", str(tmp_path / "exported" / "deeper" / "out")])
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_an_output_whose_folders_do_not_exist_yet_is_exported_into_them(run: Path, tmp_path: Path) -> None:
    """`--output exported/x` on a fresh clone, which has no exported/ (before: "the folder of --output, exported,
    does not exist: create it first")."""
    output = export_cli.main(["--adapter", str(run), "--output", str(tmp_path / "exported" / "deeper" / "out")])
    assert json.loads((output / "config.json").read_text())
    assert sorted(path.name for path in output.parent.iterdir()) == ["out"]  # no lock, no staging folder left


def test_the_exported_folder_is_readable_by_other_accounts(run: Path, tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        output = export_cli.main(["--adapter", str(run), "--output", str(tmp_path / "out")])
    finally:
        os.umask(umask)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in [output, *output.iterdir()]}
    assert modes.pop("out") == 0o755
    assert set(modes.values()) == {0o644}, modes
    assert json.loads((output / "config.json").read_text())
    assert not (tmp_path / "out.lock").exists()
