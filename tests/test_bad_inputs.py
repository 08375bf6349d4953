"""Bad input: every case fails with an error that names the culprit (file, key, row id, plugin), and a run that
fails before training writes nothing. docs/bad_inputs.md lists the cases a user meets, with the message and the test;
many cases live with the code they test (test_recipes.py, test_geoqa_data.py, test_prompts_and_images.py,
test_reward_registry.py, test_counting_rewards.py, test_evaluate.py, test_compare.py) and are not repeated here.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_script
from PIL import Image
from test_prompts_and_images import png_header_only
from test_recipes import CPU_OVERRIDES, RECIPES, config_classes
from trl import GRPOConfig, ModelConfig

from vision_grpo.data import get_dataset, get_rows
from vision_grpo.data.geoqa import GeoQADataError
from vision_grpo.data.geoqa_fixture import fixture_rows
from vision_grpo.data.prompts_and_images import RowRefused, make_example
from vision_grpo.models.embedded import TINY_MODEL
from vision_grpo.models.loading import load_model
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.rewards import BUILTIN_DIR, RewardPluginError, discover, get_reward_funcs
from vision_grpo.run.recipe_run import NothingTrained, RecipeRun

TINY_RECIPE = "recipes/shapes/tiny_cpu.yaml"
MAX_PIXELS = 168 * 168  # the tiny model's processor limit
RAISING_PLUGIN = '''
from vision_grpo.rewards import reward


@reward()
def raises_on_completions(completions, **kwargs):
    """Test only: a plugin bug that shows only once completions arrive."""
    return [1 / 0 for _ in completions]
'''
NONE_PLUGIN = '''
from vision_grpo.rewards import reward


@reward()
def raises_on_completions(completions, **kwargs):
    """Test only: a plugin whose "not mine" (None) covers every completion, so that no reward scores any."""
    return [None for _ in completions]
'''
EXITING_PLUGIN = '''
import sys

from vision_grpo.rewards import reward


@reward()
def raises_on_completions(completions, **kwargs):
    """Test only: a plugin that ends the process as if it were a script."""
    sys.exit(0)
'''


# ---------------------------------------------------------------------------------------------------------------------
# Recipes: what the entry point refuses, before it writes anything.


def train_main() -> Callable[[list[str]], Path]:
    """`main` of recipes/train.py (a script, not a module), to run it in this process."""
    spec = importlib.util.spec_from_file_location("train_entry_point", REPO / "recipes" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


GEOQA_FROM_THE_HUB = ["--task", "geoqa", "--dataset_name", "hz2475/geoQA", "--dataset_revision", "0" * 40]
GEOQA_REWARDS = ["--reward_funcs", "boxed_option", "boxed_option_format", "--reward_weights", "1", "0"]
# The recipe's four rewards with a typo in the last name (one weight each, so only the name is wrong).
TYPO = ["--reward_funcs", "count_correct", "count_description", "count_reasoning", "count_formt"]
ENTRY_POINT_CASES = {
    "unknown reward": (
        TYPO,
        RewardPluginError,
        r"unknown reward\(s\) \['count_formt'\]; available: \[.*'count_format'",
    ),
    "weights count": (["--reward_weights", "1", "2"], RecipeError, r"reward_weights has 2 values .* names 4 rewards"),
    "generation batch": (
        ["--per_device_train_batch_size", "6", "--generation_batch_size", "18"],
        RecipeError,
        r"tiny_cpu.yaml: generation_batch_size \(18\) must be divisible by num_generations \(4\)",
    ),
    "model path": (["--model_name_or_path", "./no-such-model"], FileNotFoundError, "model path ./no-such-model does"),
    "uncached hub model": (
        ["--model_name_or_path", "someone/uncached-vlm"],
        FileNotFoundError,
        "someone/uncached-vlm is not in the local Hugging Face cache and HF_HUB_OFFLINE=1",
    ),
    "dataset revision offline": (
        GEOQA_FROM_THE_HUB + GEOQA_REWARDS,
        GeoQADataError,
        r"hz2475/geoQA at revision 0{40} is not in the Hub cache .* offline .*vision_grpo.data.geoqa prepare",
    ),
    "empty dataset": (["--shapes_train_size", "0"], ValueError, "the shapes train dataset is empty after filtering"),
    "huge canvas": (["--shapes_canvas", "9000"], RecipeError, "shapes_canvas: 9000px squared exceeds 64,000,000"),
    "nothing to resume": (["--resume_from_checkpoint", "last"], FileNotFoundError, "no complete checkpoint in"),
    "no completion tokens": (
        ["--max_completion_length", "0"],
        RecipeError,
        r"tiny_cpu.yaml: max_completion_length must be at least 1, got 0; set `max_completion_length` to 1 or more",
    ),
    "negative learning rate": (["--learning_rate=-1e-5"], RecipeError, "learning_rate must be at least 0, got -1e-05"),
    "zero batch": (
        ["--per_device_train_batch_size", "0"],
        RecipeError,
        "per_device_train_batch_size must be at least 1, got 0",
    ),
    "nan learning rate": (["--learning_rate", "nan"], RecipeError, "learning_rate must be a finite number, got nan"),
    "zero temperature": (["--temperature", "0.0"], RecipeError, "temperature must be above 0, got 0.0"),
    "negative max_steps": (
        ["--max_steps", "-5"],
        RecipeError,
        r"max_steps must be at least -1, got -5; .*\(-1, the default, trains num_train_epochs\)",
    ),
    "negative rank_stall_timeout": (
        ["--rank_stall_timeout", "-1"],
        RecipeError,
        r"rank_stall_timeout must be at least 0, got -1; set `rank_stall_timeout` to 0 or more \(0 turns the watch",
    ),
    "negative reward_timeout": (
        ["--reward_timeout", "-1"],
        RecipeError,
        r"reward_timeout must be at least 0, got -1.0; set `reward_timeout` to 0 or more \(0: no limit\)",
    ),
    "no outage allowed": (
        ["--reward_outage_steps", "0"],
        RecipeError,
        r"reward_outage_steps must be at least 1, got 0",
    ),
    "unknown reward_faults": (
        ["--reward_faults", "ignore"],
        RecipeError,
        r"reward_faults: 'ignore' is not one of \['fail', 'skip'\]",
    ),
    "negative max_pixels": (
        ["--max_pixels", "-5"],
        RecipeError,
        r"max_pixels must be at least 1, got -5; set `max_pixels`",
    ),
    "huge max_pixels": (
        ["--max_pixels", "1000000000000"],
        RecipeError,
        r"max_pixels must be at most 64,000,000, got 1,000,000,000,000: no image above",
    ),
    "run name outside output_dir": (
        ["--run_name", "../elsewhere"],
        RecipeError,
        "must name a folder inside output_dir",
    ),
    "fewer prompts than one step": (
        ["--shapes_train_size", "1"],
        RecipeError,
        r"1 training prompt\(s\), fewer than the 2 one generation batch draws \(generation_batch_size 8 / num_gen",
    ),
    "no epochs": (
        ["--max_steps", "-1", "--num_train_epochs", "0"],
        RecipeError,
        r"max_steps -1 and num_train_epochs 0.0: no step to run",
    ),
    "missing local model folder": (
        ["--model_name_or_path", "models/qwen/checkpoint-100"],
        FileNotFoundError,
        r"model path models/qwen/checkpoint-100 does not exist \(a Hub id is `name` or `owner/name`",
    ),
}


@pytest.mark.parametrize("case", ENTRY_POINT_CASES)
def test_the_entry_point_refuses_bad_input_and_writes_nothing(
    case: str, tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", "")  # the entry point sets it; restored afterwards
    args, error, message = ENTRY_POINT_CASES[case]
    base = ["--config", TINY_RECIPE, "--output_dir", str(tmp_path / "runs"), "--run_name", "bad"]
    base += ["--max_steps", "1", "--shapes_train_size", "4", "--token_check_samples", "1"]
    with pytest.raises(error, match=message):
        train_main()([*base, *args])
    assert not (tmp_path / "runs").exists()


def test_data_that_cannot_fill_one_step_is_refused_before_the_model_loads(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the model loaded, transformers found no full batch, stopped at step 0 and the run exited 0 with an
    adapter that looked trained."""
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", "")
    entry = train_main()
    loads = []
    monkeypatch.setitem(entry.__globals__, "load_model", lambda *args, **kwargs: loads.append(args))
    argv = ["--config", TINY_RECIPE, "--output_dir", str(tmp_path / "runs"), "--shapes_train_size", "1"]
    with pytest.raises(RecipeError, match="fewer than the 2 one generation batch draws"):
        entry(argv)
    assert loads == []


def test_a_run_that_ends_at_step_0_exits_with_an_error_and_saves_nothing(tmp_path: Path) -> None:
    """The end of every run (GRPO and SFT): a trainer whose `train` returned without an optimizer step."""
    argv = ["--config", TINY_RECIPE, "--output_dir", str(tmp_path), "--run_name", "idle"]
    with RecipeRun.start(GRPOConfig, argv) as run:
        idle = SimpleNamespace(
            state=SimpleNamespace(global_step=0, max_steps=4),
            add_callback=lambda callback: None,
            train=lambda resume_from_checkpoint: None,
            save_model=lambda folder: pytest.fail("an untrained model was saved"),
        )
        with pytest.raises(NothingTrained, match=r"idle: training ended at step 0, no update was made"):
            run.train_and_save(idle, processor=None)
    assert json.loads((tmp_path / "idle" / "manifest.json").read_text())["ended"] is None  # no end record


def test_no_recipe_says_so_instead_of_a_bf16_error(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"no recipe: pass `--config <recipe.yaml>`, e.g. `--config recipes/shapes"):
        train_main()(["--output_dir", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()


def test_yaml_merge_keys_are_read(tmp_path: Path) -> None:
    """`<<:` failed with "could not determine a constructor for the tag 'tag:yaml.org,2002:merge'"."""
    recipe = tmp_path / "merged.yaml"
    recipe.write_text(Path(TINY_RECIPE).read_text() + "\n<<: {max_grad_norm: 0.5}\n")
    _, training_args, _ = parse_recipe(config_classes(recipe), ["--config", str(recipe)])
    assert training_args.max_grad_norm == 0.5


@pytest.mark.parametrize("inside", ["", "runs"], ids=["output_dir", "a folder above it"])
def test_an_output_dir_that_is_a_file_is_refused_naming_it(tmp_path: Path, inside: str) -> None:
    """Before: FileExistsError (or NotADirectoryError) from making the lock's folder, saying nothing of output_dir."""
    (tmp_path / "notes").write_text("keep me")
    argv = ["--config", TINY_RECIPE, "--output_dir", str(tmp_path / "notes" / inside), "--run_name", "a"]
    with pytest.raises(RecipeError, match=r"output_dir .*notes is a file, not a folder; set output_dir to a folder"):
        RecipeRun.start(GRPOConfig, argv)
    assert (tmp_path / "notes").read_text() == "keep me"


def test_the_command_line_shows_the_error_as_its_last_line(tmp_path: Path) -> None:
    process = run_script(
        ["recipes/train.py", "--config", TINY_RECIPE, "--output_dir", str(tmp_path), *TYPO], check=False
    )
    assert process.returncode == 1
    last = process.stderr.strip().splitlines()[-1]
    assert last.startswith("vision_grpo.rewards.RewardPluginError: unknown reward(s) ['count_formt']; available:")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------------
# Data: GeoQA rows as a hand-made local copy would hold them (written with pyarrow, no Hugging Face metadata).


def geoqa(source: Path, **overrides) -> TaskArguments:
    return TaskArguments(task="geoqa", dataset_name=str(source), geoqa_test_rows=0, **overrides)


def write_rows(rows: list[dict], path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def encoded(image: Image.Image, fmt: str = "PNG", **save_kwargs) -> dict:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save_kwargs)
    return {"bytes": buffer.getvalue(), "path": None}


def half_transparent(mode: str, opaque, transparent) -> Image.Image:
    image = Image.new(mode, (40, 30), opaque)
    image.paste(transparent, (20, 0, 40, 30))
    return image


def palette_image() -> dict:
    image = Image.new("P", (40, 30), 1)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)  # 0: black (made transparent), 1: red
    image.paste(0, (20, 0, 40, 30))
    return encoded(image, transparency=0)


WHITE, RED = (255, 255, 255), (255, 0, 0)
# Encoded image, then the expected colour of its left and right halves after normalisation (None: not checked).
IMAGES = {
    "CMYK JPEG": (lambda: encoded(Image.new("CMYK", (40, 30), (0, 255, 255, 0)), "JPEG", quality=95), RED, RED),
    "P with transparency": (palette_image, RED, WHITE),
    "LA": (lambda: encoded(half_transparent("LA", (0, 255), (0, 0))), (0, 0, 0), WHITE),
    "I;16": (lambda: encoded(Image.fromarray(np.full((30, 40), 65535, dtype=np.uint16))), WHITE, WHITE),
    "1-bit": (lambda: encoded(half_transparent("1", 1, 0)), WHITE, (0, 0, 0)),
}


def test_unusual_image_modes_in_a_dataset_become_rgb(tmp_path: Path) -> None:
    rows = fixture_rows(train_rows=len(IMAGES), test_rows=0, val_rows=0, seed=5)
    for row, (make, _, _) in zip(rows, IMAGES.values(), strict=True):
        row["image"] = make()
    dataset = get_dataset(geoqa(write_rows(rows, tmp_path / "modes.parquet")), "train", MAX_PIXELS)
    for (case, (_, left, right)), image in zip(IMAGES.items(), dataset["image"], strict=True):
        assert image.mode == "RGB" and image.size == (40, 30), case
        for x, expected in ((5, left), (35, right)):
            got = np.asarray(image)[15, x]
            assert np.abs(got.astype(int) - expected).max() <= 8, (case, x, got)  # JPEG is lossy


def test_an_8000_pixel_square_image_is_shrunk_to_the_processor_limit(tmp_path: Path) -> None:
    rows = fixture_rows(train_rows=1, test_rows=0, val_rows=0, seed=6)
    rows[0]["image"] = encoded(Image.new("L", (8000, 8000), 90))
    (image,) = get_dataset(geoqa(write_rows(rows, tmp_path / "huge.parquet")), "train", MAX_PIXELS)["image"]
    assert image.mode == "RGB" and image.width == image.height and image.width * image.height <= MAX_PIXELS
    assert image.getpixel((3, 3)) == (90, 90, 90)


@pytest.mark.parametrize(
    ("side", "message"),
    [
        (9000, "image of 9000x9000 pixels is larger than the 64,000,000-pixel limit"),
        (20000, r"image does not decode \(Image size \(400000000 pixels\) exceeds limit"),  # Pillow's bomb check
    ],
    ids=["9000px", "bomb"],
)
def test_an_image_beyond_the_limit_is_refused_by_row_id_before_decoding(
    tmp_path: Path, side: int, message: str
) -> None:
    """The files hold a header and no pixels: refusing them from the header alone is what keeps memory bounded."""
    rows = fixture_rows(train_rows=3, test_rows=0, val_rows=0, seed=7)
    rows[1]["image"] = {"bytes": png_header_only(side, side), "path": None}
    path = write_rows(rows, tmp_path / "bomb.parquet")
    with pytest.raises(GeoQADataError, match=rf"id={rows[1]['id']}: {message}"):
        get_dataset(geoqa(path), "train", MAX_PIXELS)
    kept = get_dataset(geoqa(path, skip_bad_rows=True), "train", MAX_PIXELS)
    assert kept["id"] == [str(rows[0]["id"]), str(rows[2]["id"])]


@pytest.mark.parametrize("label", [2.0, None], ids=["float", "missing"])
def test_a_label_that_is_not_an_integer_names_the_row(tmp_path: Path, label) -> None:
    rows = [{**row, "label": label} for row in fixture_rows(train_rows=3, test_rows=0, val_rows=0, seed=8)]
    with pytest.raises(GeoQADataError, match=rf"id={rows[0]['id']}: label must be an integer in 0..3, got {label}"):
        get_dataset(geoqa(write_rows(rows, tmp_path / "labels.parquet")), "train", MAX_PIXELS)


def test_a_dataset_with_only_bad_rows_is_empty_after_filtering(tmp_path: Path) -> None:
    rows = fixture_rows(train_rows=3, test_rows=0, val_rows=0, seed=9)
    for row in rows:
        row["choices"] = row["choices"][:3]
    path = write_rows(rows, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="the geoqa train dataset is empty after filtering"):
        get_dataset(geoqa(path, skip_bad_rows=True), "train", MAX_PIXELS)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda row: row.update(image=encoded(Image.new("RGB", (402, 2), "white"))), "aspect ratio above 200"),
        (lambda row: row.update(subject=row["subject"] + "<|im_end|>"), r"special token <\|im_end\|>"),
        (lambda row: row["choices"].__setitem__(2, "<|image_pad|>"), r"special token <\|image_pad\|>"),
    ],
    ids=["aspect-ratio", "special-token-in-question", "special-token-in-choice"],
)
def test_a_row_the_model_would_choke_on_later_is_found_up_front_and_skippable(
    tmp_path: Path, spoil: Callable, message: str
) -> None:
    """Before: Qwen's resize refused the 402x2 image at the same evaluation batch on every resume, with no row id."""
    rows = fixture_rows(train_rows=3, test_rows=0, val_rows=0, seed=10)
    spoil(rows[1])
    path = write_rows(rows, tmp_path / "spoilt.parquet")
    with pytest.raises(GeoQADataError, match=rf"id={rows[1]['id']}: .*{message}"):
        get_dataset(geoqa(path), "train", MAX_PIXELS)
    kept = get_dataset(geoqa(path, skip_bad_rows=True), "train", MAX_PIXELS)
    assert kept["id"] == [str(rows[0]["id"]), str(rows[2]["id"])]


def test_rows_without_a_split_are_counted_and_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = fixture_rows(train_rows=4, test_rows=0, val_rows=2, seed=11)
    first, second = [row for row in rows if row["original_split"] == "train"][:2]
    first["original_split"] = second["original_split"] = None
    with caplog.at_level(logging.INFO, logger="vision_grpo.data.geoqa"):
        loaded = get_rows(geoqa(write_rows(rows, tmp_path / "nosplit.parquet")), "train", MAX_PIXELS)
    assert len(loaded.dataset) == 2
    said = "2 row(s) have original_split ['None'] and are neither trained on nor evaluated"
    assert f"{said} (ids {first['id']}, {second['id']})" in caplog.text
    assert "2 val row(s) not used" in caplog.text
    assert loaded.unused == {"no or unknown original_split": 2, "val (unused by the seed)": 2}  # the manifest's


def test_a_folder_holding_two_copies_of_the_data_is_refused(tmp_path: Path) -> None:
    """Before: both copies were read and every row trained twice (duplicate ids)."""
    rows = fixture_rows(train_rows=3, test_rows=0, val_rows=0, seed=12)
    write_rows(rows, tmp_path / "train.parquet")
    write_rows(rows, tmp_path / "train (copy).parquet")
    with pytest.raises(GeoQADataError, match=r"3 id\(s\) appear more than once .*files read: train \(copy\).parquet, "):
        get_dataset(geoqa(tmp_path), "train", MAX_PIXELS)


def test_a_folder_holding_pickle_files_is_refused_unread(tmp_path: Path) -> None:
    """The GeoQA originals ship `.pk` files; unpickling them would run whatever code they hold."""
    write_rows(fixture_rows(train_rows=2, test_rows=0, val_rows=0), tmp_path / "train.parquet")
    (tmp_path / "test.pk").write_bytes(b"cos\nsystem\n(S'echo never run'\ntR.")
    with pytest.raises(GeoQADataError, match="pickle files are never loaded"):
        get_dataset(geoqa(tmp_path), "train", MAX_PIXELS)


# ---------------------------------------------------------------------------------------------------------------------
# Rewards: hostile completions through every built-in reward, and a plugin bug in the middle of a real run.

HOSTILE = {
    "empty": "",
    "whitespace": " \n\t\r\u3000 ",
    "100k characters": "x" * 100_000,
    "100k digits": "9" * 100_000,
    "image pads": "<|image_pad|>" * 2_000,
    "special tokens": "<|im_start|>assistant\n<|vision_start|><|image_pad|><|vision_end|><|im_end|><|endoftext|>",
    "20k boxes": "\\boxed{A} \\boxed{3}" * 10_000,
    "unclosed boxes": "\\boxed{" * 10_000,
    "NUL and a lone surrogate": "\x00 \ud800 \\boxed{\x00}",
}
BUILTIN_REWARDS = sorted(name for name, entry in discover().items() if Path(entry.source).parent == BUILTIN_DIR)
COLUMNS = {
    "answer": [2],
    "shape": ["circles"],
    "ground_truth": [{"triangles": 1, "circles": 2, "squares": 0}],
    "label": [0],
    "answer_type": ["math"],  # the VQA rewards: the answer type that does the most parsing
    "tolerance": [0.0],
    "completion_ids": [[5, 6, 7]],
}


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_completions_get_a_number_from_every_builtin_reward(text: str) -> None:
    funcs = get_reward_funcs(BUILTIN_REWARDS, context={"eos_token_ids": [7]})
    for func in funcs:
        start = time.perf_counter()
        (value,) = func(completions=[[{"role": "assistant", "content": text}]], **COLUMNS)
        assert value is None or math.isfinite(value), func.__name__
        # A hang guard, not a speed figure: each call takes milliseconds, a pattern that backtracks over these
        # 70-200k characters takes minutes; a bound near the real time failed on a loaded machine (2.09 s).
        assert time.perf_counter() - start < 30.0, func.__name__


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "said"),
    [
        (RAISING_PLUGIN, "{where} raised ZeroDivisionError: division by zero"),
        (EXITING_PLUGIN, "{where} called sys.exit(0) (SystemExit)"),
        (NONE_PLUGIN, "no reward scored 8 of 8 completions (rows id="),
    ],
    ids=["raises", "sys.exit(0)", "None for every completion"],
)
def test_a_plugin_that_fails_during_training_stops_the_run_naming_it(
    tiny_model_path: Path, tmp_path: Path, source: str, said: str
) -> None:
    """A plugin bug, a plugin ending the process with `sys.exit(0)`, or one that scores no completion (before: exit
    0, loss 0 and gradient 0 at every step): exit status 1 naming it, no weights."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "buggy.py").write_text(source)
    args = ["recipes/train.py", "--config", TINY_RECIPE, "--output_dir", str(tmp_path / "runs"), "--run_name", "r"]
    args += ["--reward_dirs", str(plugins), "--reward_funcs", "raises_on_completions", "--reward_weights", "1"]
    args += ["--max_steps", "2", "--shapes_train_size", "4", "--token_check_samples", "1", "--report_to", "none"]
    process = run_script(args, timeout=600, check=False)
    assert process.returncode == 1
    # The traceback's last line (tqdm may print its bar after it).
    (error,) = [
        line for line in process.stderr.splitlines() if line.startswith("vision_grpo.rewards.RewardPluginError")
    ]
    where = f"reward `raises_on_completions` ({(plugins / 'buggy.py').resolve()})"
    assert (
        error.startswith(f"vision_grpo.rewards.RewardPluginError: {said.format(where=where)}")
        and where.removeprefix("reward ") in error
    )
    run_dir = tmp_path / "runs" / "r"
    assert not list(run_dir.glob("checkpoint-*")) and not (run_dir / "adapter_model.safetensors").exists()
    assert json.loads((run_dir / "manifest.json").read_text())["ended"] is None  # never recorded as finished


# ---------------------------------------------------------------------------------------------------------------------
# Safety: remote code stays off unless asked for, and reward code is read only from where the user says.


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_no_shipped_recipe_turns_on_remote_code(recipe: Path) -> None:
    _, trainer, _ = parse_recipe(config_classes(recipe), ["--config", str(recipe), *CPU_OVERRIDES])
    assert trainer.trust_remote_code is False


def test_turning_on_remote_code_warns(tiny_model_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vision_grpo.models.loading"):
        load_model(ModelConfig(model_name_or_path=TINY_MODEL, dtype="float32"), trust_remote_code=True)
    assert f"trust_remote_code is on: code from {TINY_MODEL} will run" in caplog.text


def test_reward_code_is_read_only_from_the_rewards_folder_and_named_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "stray_reward.py").write_text(
        f"from pathlib import Path\nfrom vision_grpo.rewards import reward\nPath({str(marker)!r}).touch()\n\n\n"
        "@reward()\ndef stray_reward(completions, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)  # a plugin file in the working directory is not picked up
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardPluginError, match=r"unknown reward\(s\) \['stray_reward'\]"):
        get_reward_funcs(["stray_reward"])
    assert not marker.exists()
    (func,) = get_reward_funcs(["stray_reward"], extra_dirs=[tmp_path])
    assert marker.exists() and func(completions=["a"]) == [0.0]


# ---------------------------------------------------------------------------------------------------------------------
# The table of docs/bad_inputs.md: each row is a test, so every test it names must exist.

TABLE = REPO / "docs" / "bad_inputs.md"
TEST_REFERENCE = re.compile(r"(test_\w+\.py)?::(test_\w+)(?:\[([^\]]+)\])?")


CATEGORIES = {"concurrency", "resume identity", "data loss", "late error", "message", "robustness", "safety"}


def table_rows(text: str) -> list[dict[str, str]]:
    """Every row of the markdown tables in `text`, as {column name: cell}; columns are read by their header's name."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if header is None:
            header = cells
        elif set(line) - set("|-"):
            assert len(cells) == len(header), f"{len(cells)} cells under {len(header)} columns: {line}"
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


def test_every_test_named_in_the_bad_input_table_exists() -> None:
    rows = table_rows(TABLE.read_text(encoding="utf-8"))
    assert len(rows) >= 50
    for row in rows:
        assert row.get("category") in CATEGORIES, f"category must be one of {sorted(CATEGORIES)}: {row}"
        file = None
        for match in TEST_REFERENCE.finditer(row["test"]):
            file = match.group(1) or file
            assert file, f"{match.group(0)} names no file: {row}"
            module = importlib.import_module(file.removesuffix(".py"))
            test = getattr(module, match.group(2), None)
            assert callable(test), f"{file}::{match.group(2)} does not exist"
            if match.group(3):  # a parametrized case: its id must be one of the test's
                ids = {i for mark in getattr(test, "pytestmark", []) if mark.name == "parametrize" for i in _ids(mark)}
                assert match.group(3) in ids, f"{file}::{match.group(2)} has no case [{match.group(3)}]: {ids}"
        assert TEST_REFERENCE.search(row["test"]), f"no test named: {row}"


def _ids(mark: pytest.Mark) -> list[str]:
    """The ids of a parametrize mark: explicit `ids`, else the values when they are strings (pytest's default)."""
    ids = mark.kwargs.get("ids")
    if ids is None:
        return [str(value) for value in mark.args[1] if isinstance(value, str)]
    return [ids(value) for value in mark.args[1]] if callable(ids) else list(ids)


def test_a_key_set_twice_in_a_recipe_is_refused_naming_both_lines(tmp_path: Path) -> None:
    recipe = tmp_path / "twice.yaml"
    recipe.write_text(Path(REPO / TINY_RECIPE).read_text() + "learning_rate: 1.0e-5\n")
    line = Path(REPO / TINY_RECIPE).read_text().splitlines().index("learning_rate: 1.0e-3") + 1
    last = len(recipe.read_text().splitlines())
    with pytest.raises(RecipeError, match=rf"key `learning_rate` is set twice \(lines {line} and {last}\); keep one"):
        parse_recipe(config_classes(recipe), ["--config", str(recipe)])


@pytest.mark.parametrize(
    ("text", "size", "message"),
    [("How many <|vision_start|>?", (40, 30), "special token"), ("How many?", (1000, 4), "aspect ratio above 200")],
)
def test_every_task_refuses_such_rows_when_it_builds_them(text: str, size: tuple, message: str) -> None:
    """`make_example` is every task's row builder: the last line of defence names the example."""
    with pytest.raises(RowRefused, match=rf"example row-7: .*{message}"):
        make_example("row-7", text, Image.new("RGB", size), "before_text", MAX_PIXELS)
