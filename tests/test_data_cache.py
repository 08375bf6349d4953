"""The checking pass runs once and is cached (data/prepared.py): a second start reads the cache, a key that does not
decide the rows reuses it, a deciding key or an edited source rebuilds it; a resume notices data edited in place."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import datasets
import pytest
from conftest import REPO, run_script
from PIL import Image
from test_resume import earlier_run
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset, prepared
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.run.recipe_run import RecipeRun
from vision_grpo.run.resume import RunConflict

MAX_PIXELS = 168 * 168


def write_source(folder: Path, answers: list[str]) -> Path:
    (folder / "images").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), "white").save(folder / "images" / "a.png")
    lines = [{"id": f"r{i}", "image": "a.png", "question": "How many?", "answer": a} for i, a in enumerate(answers)]
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def recipe(folder: Path, *extra: str) -> list[str]:
    return [
        "--task", "vqa", "--dataset_name", str(folder), "--vqa_image_folder", str(folder / "images"),
        "--vqa_answer_type", "number", "--use_cpu", "true", *extra,
    ]  # fmt: skip


def passes(caplog: pytest.LogCaptureFixture, argv: list[str], max_pixels: int = MAX_PIXELS) -> str:
    """'checked' when this start ran the pass, 'cached' when it read an earlier start's result."""
    caplog.clear()
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), argv)[0]
    with caplog.at_level(logging.INFO, logger="vision_grpo.data.prepared"):
        get_dataset(args, "train", max_pixels)
    assert len(caplog.records) == 1, caplog.text
    return "cached" if "read from the cache" in caplog.text else "checked"


def test_the_pass_is_cached_reused_by_other_keys_and_rebuilt_by_deciding_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = write_source(tmp_path / "data", ["1", "2", "3"])
    assert passes(caplog, recipe(folder)) == "checked"
    assert passes(caplog, recipe(folder)) == "cached"
    assert passes(caplog, recipe(folder, "--learning_rate", "0.5")) == "cached"  # not a deciding key
    assert passes(caplog, recipe(folder), max_pixels=MAX_PIXELS // 2) == "checked"
    assert passes(caplog, recipe(folder, "--vqa_prompt_template", "Q: {{ question }}")) == "checked"
    assert passes(caplog, recipe(folder, "--vqa_answer_type", "exact")) == "checked"
    assert passes(caplog, recipe(folder, "--vqa_train_split", "test")) == "checked"  # another file
    write_source(folder, ["1", "2", "4"])  # the source edited under the same path
    assert passes(caplog, recipe(folder)) == "checked"
    assert passes(caplog, recipe(folder)) == "cached"


def test_a_resume_after_the_answers_were_edited_in_place_is_refused(tmp_path: Path) -> None:
    folder = write_source(tmp_path / "data", ["1", "2", "3", "4", "5", "6", "7", "8"])
    argv = [
        "--config", "recipes/vqa/tiny_clevr_count.yaml", "--dataset_name", str(folder),
        "--vqa_image_folder", str(folder / "images"), "--vqa_image_column", "image",
        "--vqa_question_column", "question", "--vqa_answer_column", "answer",
        "--output_dir", str(tmp_path / "runs"), "--run_name", "r", "--report_to", "none",
    ]  # fmt: skip
    run_dir = earlier_run(tmp_path, argv)
    resume = [*argv, "--resume_from_checkpoint", "last"]
    with RecipeRun.start(GRPOConfig, resume) as run:  # the same data: resumed
        assert run.resume_from == str(run_dir / "checkpoint-2")
    write_source(folder, ["1", "2", "3", "4", "5", "6", "7", "9"])  # one answer edited, same path, same size
    with pytest.raises(RunConflict, match=r"dataset: .*source_sha256"):
        RecipeRun.start(GRPOConfig, resume)


SCRIPT = """
import logging, os, sys
from trl import GRPOConfig, ModelConfig
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.data import get_dataset, prepared
logging.basicConfig(level=logging.INFO, format=f"RANK{os.environ['RANK']} %(name)s: %(message)s")
args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), sys.argv[1:])[0]
print(f"RANK{os.environ['RANK']} of {os.environ['WORLD_SIZE']}: {len(get_dataset(args, 'train', 28224))} rows")
"""


@pytest.mark.slow
def test_two_processes_run_the_pass_once_and_the_other_reads_its_cache(tmp_path: Path) -> None:
    folder = write_source(tmp_path / "data", [str(i) for i in range(20)])
    script = tmp_path / "load.py"
    script.write_text(SCRIPT)
    launch = ["-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml")]
    env = {"HF_HOME": str(tmp_path / "hf")}  # a cache of its own: the pass has not run yet
    done = run_script([*launch, "--num_processes", "2", str(script), *recipe(folder)], env=env, timeout=300)
    output = done.stdout + done.stderr
    assert "RANK0 of 2: 20 rows" in output and "RANK1 of 2: 20 rows" in output, output[-3000:]
    ran = [line for line in output.splitlines() if "checked 20 rows" in line]
    read = [line for line in output.splitlines() if "checked rows read from the cache" in line]
    assert len(ran) == 1 and ran[0].startswith("RANK0") and "process 0 (local 0" in ran[0], output[-3000:]
    assert len(read) == 1 and read[0].startswith("RANK1"), output[-3000:]
    assert os.path.isdir(tmp_path / "hf" / "datasets" / "vision_grpo_rows")


@pytest.mark.parametrize(
    "feature",
    [datasets.Image(decode=False), datasets.List(datasets.Image(decode=False)), [datasets.Image(decode=False)]],
    ids=["image", "list", "sequence"],
)
def test_an_undecoded_image_column_is_not_cast_again(feature) -> None:
    """Casting a list-of-images column makes `datasets` write a copy of every image: a column that is already
    undecoded (the VQA task casts its source once) must come back as it is, so the pass joins it without a copy."""
    assert prepared.undecoded(feature) is feature
