"""The checking pass runs once and is cached (data/prepared.py): a second start reads the cache, a key that does not
decide the rows reuses it, a deciding key or an edited source rebuilds it; a resume notices data edited in place;
two launches at once on one key build it once, and a reader arriving during a rebuild waits and reads it whole."""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
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
from vision_grpo.storage.seals import seal_fault

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


# ---------------------------------------------------------------------------------------------------------------------
# Two launches at once on one key (data/prepared.py's lock per key): separate processes, each a whole launch of one.

CONCURRENT = """
import glob, json, logging, sys, time
from pathlib import Path
import datasets
from trl import GRPOConfig, ModelConfig
from vision_grpo.data import get_dataset
from vision_grpo.recipe.arguments import TaskArguments
from vision_grpo.recipe.parse import parse_recipe

name, sync, cache, start_when = sys.argv[1:5]
datasets.config.HF_DATASETS_CACHE = cache  # the test's own cache (an HF_ variable would need a fresh interpreter)
logging.basicConfig(level=logging.INFO, format=f"{name} %(name)s: %(message)s")
args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), sys.argv[5:])[0]
Path(sync, name).touch()  # ready: imports and parsing done
deadline = time.monotonic() + 120
while not glob.glob(start_when):
    if time.monotonic() > deadline:
        sys.exit(f"{name}: {start_when} never appeared")
    time.sleep(0.005)
started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
rows = get_dataset(args, "train", 28224)
print(json.dumps({"rows": len(rows), "ids": list(rows["id"]), "started": started, "ended": time.monotonic()}))
"""
ROWS = 2000  # a pass of about a second: long enough for the other process to arrive while it runs


def prepare_at_once(tmp_path: Path, folder: Path, cache: Path, start_when: dict[str, str]) -> dict[str, dict]:
    """Run the pass in one process per entry of `start_when` (name: the glob it starts at), all at once: each starts
    when its glob matches, after all are ready and `<tmp_path>/go` exists. Returns each one's rows, times and log."""
    script, sync = tmp_path / "prepare.py", tmp_path / "sync"
    script.write_text(CONCURRENT)
    sync.mkdir()
    with ThreadPoolExecutor(len(start_when)) as pool:
        runs = {
            name: pool.submit(run_script, [str(script), name, str(sync), str(cache), glob, *recipe(folder)], 120)
            for name, glob in start_when.items()
        }
        deadline = time.monotonic() + 120
        while len(list(sync.iterdir())) < len(runs) and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / "go").touch()
        done = {name: run.result() for name, run in runs.items()}
    return {name: {**json.loads(run.stdout.splitlines()[-1]), "log": run.stderr} for name, run in done.items()}


def one_sealed_cache(cache: Path) -> None:
    rows_dir = cache / prepared.ROWS_CACHE
    (arrow,) = rows_dir.glob("*.arrow")
    assert seal_fault(arrow, key=arrow.stem, rows=ROWS) is None
    assert not list(rows_dir.glob("tmp*")), "a half-written file was left"


def test_two_launches_preparing_one_key_at_once_build_one_cache_and_both_read_it(tmp_path: Path) -> None:
    folder = write_source(tmp_path / "data", [str(i % 10) for i in range(ROWS)])
    cache = tmp_path / "datasets"
    go = str(tmp_path / "go")
    runs = prepare_at_once(tmp_path, folder, cache, {"A": go, "B": go})
    built = [name for name, run in runs.items() if f"checked {ROWS} rows (" in run["log"]]
    assert len(built) == 1, "the pass ran more than once"
    (builder,) = built
    (reader,) = set(runs) - {builder}
    assert f"{ROWS} checked rows read from the cache" in runs[reader]["log"]
    assert "is being prepared by another process: waiting for it to finish" in runs[reader]["log"]
    assert runs[reader]["started"] < runs[builder]["ended"], "the two did not run at once"
    assert runs["A"]["rows"] == runs["B"]["rows"] == ROWS and runs["A"]["ids"] == runs["B"]["ids"]
    one_sealed_cache(cache)


def test_a_reader_arriving_while_a_damaged_cache_is_rebuilt_waits_and_reads_the_whole_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader starts once the rebuild's temporary file exists (the rebuild is under way): it waits for the
    seal, then reads every row, and nothing rebuilds it twice."""
    folder = write_source(tmp_path / "data", [str(i % 10) for i in range(ROWS)])
    cache = tmp_path / "datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    args = parse_recipe((TaskArguments, GRPOConfig, ModelConfig), recipe(folder))[0]
    assert len(get_dataset(args, "train", 28224)) == ROWS
    (arrow,) = (cache / prepared.ROWS_CACHE).glob("*.arrow")
    with arrow.open("r+b") as file:
        file.truncate(4096)
    start_when = {"rebuilder": str(tmp_path / "go"), "reader": str(cache / prepared.ROWS_CACHE / "tmp*")}
    runs = prepare_at_once(tmp_path, folder, cache, start_when)
    assert f"the rows cache {arrow} cannot be used" in runs["rebuilder"]["log"]
    assert f"checked {ROWS} rows (" in runs["rebuilder"]["log"]
    assert f"{ROWS} checked rows read from the cache" in runs["reader"]["log"], "the reader rebuilt it too"
    assert "is being prepared by another process: waiting" in runs["reader"]["log"]
    assert runs["reader"]["rows"] == runs["rebuilder"]["rows"] == ROWS
    assert runs["reader"]["ids"] == runs["rebuilder"]["ids"]
    one_sealed_cache(cache)
