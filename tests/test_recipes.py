"""Every shipped recipe parses with its trainer's config, and broken recipes fail early with a useful message."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import FAMILY_MODELS
from trl import GRPOConfig, ModelConfig, SFTConfig

from vision_grpo.evaluation.eval_options import EvalArguments
from vision_grpo.models.loading import load_model
from vision_grpo.models.lora import check_lora_targets, get_peft_config
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.bounds import DURATIONS, UPPER_BOUNDS, WEEK
from vision_grpo.recipe.parse import parse_recipe
from vision_grpo.rewards import get_reward_funcs

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted(p for p in (REPO / "recipes").rglob("*") if p.suffix in (".yaml", ".yml"))
GRPO_CLASSES = (TaskArguments, GRPOConfig, ModelConfig)
# GPU recipes set `bf16: true`, which the trainer config rejects on a CPU-only machine; parsing here overrides it.
CPU_OVERRIDES = ["--bf16", "false", "--use_cpu", "true"]


def config_classes(recipe: Path) -> tuple[type, ...]:
    """SFT recipes (the file name says `sft`) run on TRL's SFTConfig, all others on GRPOConfig."""
    return (TaskArguments, SFTConfig, ModelConfig) if "sft" in recipe.name else GRPO_CLASSES


def write_recipe(folder: Path, **overrides) -> Path:
    """The CPU smoke recipe with some keys changed."""
    content = yaml.safe_load((REPO / "recipes" / "shapes" / "tiny_cpu.yaml").read_text())
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump({**content, **overrides}))
    return path


def test_every_recipe_the_docs_name_is_one_these_tests_parse() -> None:
    """The recipes the tests below run over hold every recipe the README and docs send a reader to: a recipe moved
    or renamed without its docs, or a collection that misses a folder, fails here."""
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {REPO / m for doc in documents for m in re.findall(r"recipes/[\w/.-]+\.ya?ml", doc.read_text("utf-8"))}
    assert named, "the docs name no recipe"
    assert named <= set(RECIPES), f"named in the docs, not parsed here: {sorted(map(str, named - set(RECIPES)))}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_every_recipe_parses_and_names_existing_rewards(recipe: Path) -> None:
    classes = config_classes(recipe)
    task, trainer, _model = parse_recipe(classes, ["--config", str(recipe), *CPU_OVERRIDES])
    if classes is GRPO_CLASSES:
        assert len(get_reward_funcs(task.reward_funcs, task.reward_dirs)) == len(task.reward_funcs)
        assert trainer.reward_weights is None or len(trainer.reward_weights) == len(task.reward_funcs)


def test_command_line_flags_override_the_recipe(tmp_path: Path) -> None:
    path = write_recipe(tmp_path)
    task, trainer, model = parse_recipe(
        GRPO_CLASSES,
        ["--config", str(path), "--max_steps", "7", "--reward_funcs", "count_correct", "count_format"]
        + ["--reward_weights", "1", "0.5"],  # one weight per reward, or the recipe is refused
    )
    assert trainer.max_steps == 7
    assert task.reward_funcs == ["count_correct", "count_format"]
    assert model.lora_r == 8  # untouched keys keep the recipe's value


def test_an_unknown_key_fails_with_the_nearest_key(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, learning_rat=1e-4)
    with pytest.raises(RecipeError, match="unknown key `learning_rat`; did you mean `learning_rate`"):
        parse_recipe(GRPO_CLASSES, ["--config", str(path)])


def test_trls_env_block_sets_its_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's recipe format: `env:` maps environment variables to values, set while the recipe is parsed."""
    monkeypatch.delenv("VISION_GRPO_RECIPE_ENV", raising=False)
    path = write_recipe(tmp_path, env={"VISION_GRPO_RECIPE_ENV": 7})
    parse_recipe(GRPO_CLASSES, ["--config", str(path)])
    assert os.environ["VISION_GRPO_RECIPE_ENV"] == "7"


@pytest.mark.parametrize("env", [["HF_HUB_OFFLINE=1"], {"HF_HUB_OFFLINE": [1]}, "HF_HUB_OFFLINE=1"])
def test_an_env_block_that_is_not_a_mapping_of_values_is_refused(tmp_path: Path, env) -> None:
    path = write_recipe(tmp_path, env=env)
    with pytest.raises(RecipeError, match="`env` must map variable names to values"):
        parse_recipe(GRPO_CLASSES, ["--config", str(path)])


@pytest.mark.parametrize(
    ("text", "message"),
    [("model: [unclosed\n", "not valid YAML"), ("- a list\n- not a mapping\n", "must be a mapping"), ("", "mapping")],
)
def test_a_file_that_is_not_a_yaml_mapping_fails_clearly(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(GRPO_CLASSES, ["--config", str(path)])


def test_a_missing_recipe_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="does not exist"):
        parse_recipe(GRPO_CLASSES, ["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_steps", 2.5),
        ("shapes_train_size", True),
        ("use_peft", 3),
        ("save_strategy", False),  # what YAML makes of an unquoted `save_strategy: no`
        ("lora_r", [8]),
        ("reward_funcs", [1, 2]),
        ("max_steps", None),
    ],
)
def test_a_value_of_the_wrong_type_fails_naming_the_key(tmp_path: Path, key: str, value) -> None:
    path = write_recipe(tmp_path, **{key: value})
    with pytest.raises(RecipeError, match=f"`{key}: "):
        parse_recipe(GRPO_CLASSES, ["--config", str(path)])


def test_a_string_that_is_not_a_number_fails_naming_the_flag(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, max_steps="four")
    with pytest.raises(RecipeError, match=r"recipe .*recipe.yaml: argument --max_steps.*: invalid int value: 'four'"):
        parse_recipe(GRPO_CLASSES, ["--config", str(path)])


def test_invalid_task_values_fail(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, shapes_layout="scattered")
    with pytest.raises(RecipeError, match="shapes_layout"):
        parse_recipe(GRPO_CLASSES, ["--config", str(path)])


@pytest.mark.parametrize("family", FAMILY_MODELS)
def test_a_lora_target_that_names_no_module_is_refused_listing_the_layers(family: str) -> None:
    """Before: peft's "No modules were targeted for adaptation", naming nothing, after the trainer was set up; and
    with one good entry beside the typo, a silent run with fewer adapted layers."""
    model_args = ModelConfig(model_name_or_path=family, use_peft=True, dtype="float32")
    model = load_model(model_args, trust_remote_code=False)
    task_args = SimpleNamespace(lora_on_vision=False)
    for targets in (["q_projj"], ["q_proj", "q_projj"]):
        model_args.lora_target_modules = targets
        with pytest.raises(
            RecipeError, match=r"lora_target_modules: `q_projj` names no module .*did you mean `q_proj`"
        ):
            check_lora_targets(model, get_peft_config(model_args, task_args))
    with pytest.raises(RecipeError) as refused:
        model_args.lora_target_modules = ["attn.qkv"]  # the vision tower's attention, left alone by default
        check_lora_targets(model, get_peft_config(model_args, task_args))
    assert "only in the vision tower, which LoRA leaves alone unless `lora_on_vision: true`" in str(refused.value)
    listed = str(refused.value).split("linear layers are ")[1]
    assert all(name in listed for name in ("'q_proj'", "'down_proj'")) and "'qkv'" not in listed
    model_args.lora_target_modules = ["q_proj", "v_proj"]
    check_lora_targets(model, get_peft_config(model_args, task_args))  # names that exist pass
    model_args.lora_target_modules = None
    check_lora_targets(model, get_peft_config(model_args, task_args))  # all-linear


def test_a_python_tag_in_a_recipe_runs_nothing(tmp_path: Path) -> None:
    """Recipes are data: YAML's python tags (`!!python/object/apply:os.system`) are refused by the safe loader."""
    marker = tmp_path / "ran"
    recipe = tmp_path / "tagged.yaml"
    recipe.write_text(f'run_name: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(RecipeError, match="is not valid YAML: could not determine a constructor for the tag"):
        parse_recipe((TaskArguments, GRPOConfig, ModelConfig), ["--config", str(recipe)])
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"recipe .*recipes is a folder, not a recipe file: pass a .yaml file to --config, e.g. `--config "),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"recipe .*recipe.yaml is a binary file, not YAML: pass the recipe"),
        ("model_name_or_path: caf\xe9\n".encode("latin-1"), r"is not UTF-8 text \(byte 0xe9 at offset 23\): save it"),
    ],
    ids=["folder", "binary", "latin-1"],
)
def test_a_folder_or_a_binary_file_as_recipe_is_named_in_one_line(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    """Before: `IsADirectoryError` (or 'recipe ... does not exist' for a folder) and a `UnicodeDecodeError`
    traceback."""
    if content is None:
        path = tmp_path / "recipes"
        path.mkdir()
        write_recipe(path)
    else:
        path = tmp_path / "recipe.yaml"
        path.write_bytes(content)
    with pytest.raises(RecipeError, match=message) as refused:
        parse_recipe(GRPO_CLASSES, ["--config", str(path)])
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        ("learning_rate\u200b", r"'learning_rate\\u200b' \(it holds U\+200B ZERO WIDTH SPACE: retype it\)"),
        ("learning\xa0rate", r"'learning\\xa0rate' \(it holds U\+00A0 NO-BREAK SPACE: retype it\)"),
        ("\ufefflearning_rate", r"'\\ufefflearning_rate' \(it holds U\+FEFF ZERO WIDTH NO-BREAK SPACE: retype it\)"),
        ("le\u0430rning_rate", r"'le\\u0430rning_rate' \(it holds U\+0430 CYRILLIC SMALL LETTER A: retype it\)"),
    ],
    ids=["zero-width space", "non-breaking space", "BOM", "Cyrillic a"],
)
def test_an_invisible_character_in_a_key_is_shown_escaped(tmp_path: Path, key: str, shown: str) -> None:
    """Before: "unknown key `learning_rate​`; did you mean `learning_rate`?", the two names looking the same."""
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model_name_or_path: vision-grpo/tiny-qwen2.5-vl\n{key}: 1.0e-4\n", encoding="utf-8")
    with pytest.raises(RecipeError, match=rf"unknown key {shown}; did you mean `learning_rate`\?"):
        parse_recipe(GRPO_CLASSES, ["--config", str(path)])
    with pytest.raises(RecipeError, match=rf"unknown flag {shown.replace(chr(39), chr(39) + '--', 1)}"):
        parse_recipe(GRPO_CLASSES, [f"--{key}", "1e-4"])


def _duration_keys() -> set[str]:
    """Every numeric recipe key in seconds, by its name or its help."""
    found = set()
    for cls in (*GRPO_CLASSES, SFTConfig, EvalArguments):
        for f in dataclasses.fields(cls):
            said = f"{f.name} {f.metadata.get('help', '')}"
            if f.type in (int, float, "int", "float") and re.search(r"timeout|interval|\bseconds\b", said, re.I):
                found.add(f.name)
    return found


def test_every_duration_key_has_a_finite_upper_bound() -> None:
    assert {"rank_stall_timeout", "reward_timeout", "ddp_timeout"} <= _duration_keys()
    assert _duration_keys() <= set(UPPER_BOUNDS), f"unbounded: {_duration_keys() - set(UPPER_BOUNDS)}"


@pytest.mark.parametrize("key", sorted(DURATIONS))
def test_a_duration_above_a_week_is_refused_naming_the_key(tmp_path: Path, key: str) -> None:
    """Before: accepted; a reward_timeout above threading.TIMEOUT_MAX killed its watcher thread mid-run."""
    path = write_recipe(tmp_path)
    parse_recipe(GRPO_CLASSES, ["--config", str(path), f"--{key}", str(WEEK)])  # a week passes
    with pytest.raises(
        RecipeError, match=rf"{key} must be at most 604,800, got 1,000,000,000(\.0)?: 604,800 s is a week"
    ):
        parse_recipe(GRPO_CLASSES, ["--config", str(path), f"--{key}", "1000000000"])


def test_token_check_samples_below_minus_one_is_refused(tmp_path: Path) -> None:
    """Before: -5 silently checked every prompt, as -1 does."""
    path = write_recipe(tmp_path, token_check_samples=-5)
    with pytest.raises(RecipeError, match=r"token_check_samples must be at least -1, got -5; .*\(-1 checks every"):
        parse_recipe(GRPO_CLASSES, ["--config", str(path)])
    task, _, _ = parse_recipe(GRPO_CLASSES, ["--config", str(path), "--token_check_samples", "-1"])
    assert task.token_check_samples == -1
