"""`python -m vision_grpo.plan` misused: sizes and counts out of range, a text-only model, an accelerate config that
is missing, not YAML or not a mapping. Each is one line naming the flag or file, at once (before: a hang on a
trillion pixels, a complex square root, values silently accepted, raw AttributeErrors)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Qwen2Config

from vision_grpo.data.prompts_and_images import MAX_DECODE_PIXELS
from vision_grpo.plan import plan_command as plan_cli
from vision_grpo.recipe.bounds import PIXEL_CEILING

RECIPE = ["--config", "recipes/geoqa/qwen3_5_4b_lora.yaml"]


def test_the_pixel_ceiling_is_the_datas_decode_limit() -> None:
    assert PIXEL_CEILING == MAX_DECODE_PIXELS


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num_processes", "0"], "argument --num_processes: num_processes must be at least 1, got 0; set --num"),
        (["--num_processes", "-4"], "argument --num_processes: num_processes must be at least 1, got -4"),
        (["--image_pixels", "0"], "argument --image_pixels: image_pixels must be at least 1, got 0"),
        (["--image_pixels", "-3"], "argument --image_pixels: image_pixels must be at least 1, got -3"),
        (["--image_pixels", "1" + "0" * 12], "image_pixels must be at most 64,000,000"),
        (["--images_per_prompt", "0"], "argument --images_per_prompt: images_per_prompt must be at least 1"),
        (["--prompt_text_tokens", "-1"], "argument --prompt_text_tokens: prompt_text_tokens must be at least 0"),
        (["--expected_completion_length", "0"], "expected_completion_length must be at least 1, got 0"),
        (["--dead_group_share", "1"], "--dead_group_share: a fraction of at least 0 and below 1, got '1'"),
        (["--dead_group_share", "a third"], "--dead_group_share: a fraction of at least 0 and below 1, got 'a third'"),
    ],
)
def test_a_plan_flag_out_of_range_is_refused_naming_it(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        plan_cli.main([*RECIPE, *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max_pixels", "1" + "0" * 12], "max_pixels must be at most 64,000,000, got 1,000,000,000,000"),
        (["--max_pixels", "-5"], "max_pixels must be at least 1, got -5; set `max_pixels` to 1 or more"),
        (["--min_pixels", "0"], "min_pixels must be at least 1, got 0"),
        (["--min_pixels", "2000000", "--max_pixels", "1000000"], "min_pixels (2,000,000) is above max_pixels"),
    ],
)
def test_recipe_pixel_limits_out_of_range_are_refused_at_once(flags: list[str], message: str, capsys) -> None:
    assert plan_cli.main([*RECIPE, *flags]) == 1
    assert message in capsys.readouterr().err


def test_a_text_only_model_is_named(tmp_path: Path, capsys) -> None:
    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4).save_pretrained(
        tmp_path
    )
    assert plan_cli.main([*RECIPE, "--model_name_or_path", str(tmp_path)]) == 1
    assert "is a text-only model (Qwen2Config, no vision_config)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read it (No such file or directory); pass a config file"),
        ("x: [1\n", "is not valid YAML: while parsing a flow sequence"),
        ("- a\n- b\n", "must be a mapping of keys to values (as `accelerate config` writes it), got list"),
        ("distributed_type: MULTI_GPU\nnum_processes: 0\n", "num_processes must be an integer of at least 1, got 0"),
    ],
    ids=["missing", "not yaml", "a list", "zero processes"],
)
def test_a_bad_accelerate_config_is_named(content: str | None, message: str, tmp_path: Path, capsys) -> None:
    config = tmp_path / "acc.yaml"
    if content is not None:
        config.write_text(content)
    assert plan_cli.main([*RECIPE, "--accelerate_config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"--accelerate_config {config}" in err and message in err and "\n" not in err.strip()
