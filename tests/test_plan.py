"""The memory plan: its layer formula against what autograd keeps on a tiny replica, the refusal before the model
loads on a GPU too small (the GPU's size faked, not the plan), and the command on every shipped recipe, offline."""

from __future__ import annotations

import contextlib
import logging
import types
from pathlib import Path

import pytest
import torch

from vision_grpo.plan import check as plan_check
from vision_grpo.plan import estimate as plan_build
from vision_grpo.plan import formulas as mf
from vision_grpo.plan import plan_command as plan_cli
from vision_grpo.plan.parts import GiB
from vision_grpo.recipe.arguments import RecipeError

REPO = Path(__file__).resolve().parents[1]
# Every GRPO recipe (the SFT warm starts, recipes/sft.py's, are another trainer the plan does not model)
RECIPES = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").glob("**/*.yaml") if "sft" not in p.name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_plan_command_runs_offline_on_every_shipped_recipe(recipe: str, capsys, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    assert plan_cli.main(["--config", recipe]) == 0
    out = capsys.readouterr().out
    assert "peak (" in out and "141 GiB card" in out and "weights" in out


def test_layer_formula_matches_what_autograd_keeps_on_the_tiny_replica(tiny_model_path: Path) -> None:
    """LoRA on every linear, bf16 autocast: the second decoder layer's saved tensors within 10% of the formula
    (full fine-tuning's terms, one saved input per projection input, are 20% off)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(tiny_model_path)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    layers = model.base_model.model.model.language_model.layers
    current = ["other"]
    layers[1].register_forward_pre_hook(lambda m, a: current.__setitem__(0, "layer 1"))
    layers[1].register_forward_hook(lambda m, a, o: current.__setitem__(0, "other"))
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: set[int] = set()
    kept = {"layer 1": 0, "other": 0}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in params and storage._cdata not in seen:
            seen.add(storage._cdata)
            kept[current[0]] += storage.nbytes()
        return tensor

    tokens = 2048
    ids = torch.randint(0, config.get_text_config().vocab_size - 20, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model.base_model.model.model.language_model(input_ids=ids, use_cache=False)
    planned = (
        mf.text_layer_bytes_per_token(mf.shape_of(config), "full_attention", 8, first=False, deltanet="torch") * tokens
    )
    assert 0.9 < kept["layer 1"] / planned < 1.1, (kept, planned)


@pytest.mark.parametrize("layer_type", ["linear_attention", "full_attention"])
@pytest.mark.parametrize("fake", [False, True], ids=["real-tensors-eighth-width", "fake-tensors-real-width"])
def test_qwen3_5_layer_formula_matches_what_autograd_keeps(layer_type: str, fake: bool) -> None:
    """Qwen3.5's shipped config, two layers of one type, bf16 autocast, LoRA on every linear: the second layer's
    saved tensors (still alive at the end of the forward, weights left out) within 20% of the formula. On real
    tensors at 1/8 of the width; at the real width on fake tensors (real shapes, dtypes and autocast, no data: this
    CPU's bf16 matmuls are too slow for real ones), where the Gated DeltaNet term counted on the meta device was
    34% high."""
    from peft import LoraConfig, get_peft_model
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(plan_build.SHIPPED_CONFIGS / "Qwen--Qwen3.5-4B.json")
    text = config.get_text_config()
    text.num_hidden_layers, text.layer_types, text.vocab_size = 2, [layer_type] * 2, 512
    if not fake:
        text.hidden_size, text.intermediate_size, text.num_attention_heads, text.num_key_value_heads = 320, 1152, 4, 1
        text.linear_num_key_heads, text.linear_num_value_heads = 2, 4
    config.vision_config.depth = 1
    torch.manual_seed(0)
    lora = LoraConfig(r=8, target_modules="all-linear", exclude_modules=r".*visual.*")
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with torch.device("meta") if fake else contextlib.nullcontext():
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = get_peft_model(model, lora)
    if fake:
        with mode:
            mf.materialise_fake(model)
    language_model = model.base_model.model.model.language_model
    current = ["other"]
    language_model.layers[1].register_forward_pre_hook(lambda m, a: current.__setitem__(0, "layer 1"))
    language_model.norm.register_forward_pre_hook(lambda m, a: current.__setitem__(0, "other"))
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, tuple[str, StorageWeakRef, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = (current[0], StorageWeakRef(storage), storage.nbytes())
        return tensor

    tokens = 128
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = language_model(input_ids=torch.zeros(1, tokens, dtype=torch.long), use_cache=False)
        kept = sum(size for label, ref, size in saved.values() if label == "layer 1" and not ref.expired())
        del output
    planned = mf.text_layer_bytes_per_token(mf.shape_of(config), layer_type, 8, first=False, deltanet="torch") * tokens
    assert 0.8 < kept / planned < 1.2, (kept, planned)


def _recipe(path: str, *overrides: str):
    from trl import GRPOConfig, ModelConfig

    from vision_grpo.recipe.arguments import TaskArguments
    from vision_grpo.recipe.parse import parse_recipe

    task_args, training_args, model_args = parse_recipe(
        (TaskArguments, GRPOConfig, ModelConfig), ["--config", path, "--use_cpu", "true", *overrides]
    )
    training_args.use_cpu = False  # as on the GPU machine the recipe is meant for
    return task_args, training_args, model_args


def _fake_gpu(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    properties = types.SimpleNamespace(total_memory=int(gib * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)


def test_a_plan_over_the_present_gpu_is_refused_naming_the_key(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    _fake_gpu(monkeypatch, 16)
    # Qwen3-VL GeoQA peaks in decoding (the cache of 64 sequences), so the key is the generation batch's
    with pytest.raises(
        RecipeError, match=r"this GPU \(Fake GPU\) has 16.0 GiB: it does not fit even if the plan is 20%"
    ):
        plan_check.check_before_training(*_recipe("recipes/geoqa/qwen3_vl_4b_lora.yaml"))


def test_a_plan_within_its_error_of_the_gpu_warns_instead_of_refusing(monkeypatch, caplog) -> None:
    """Qwen3-VL's GeoQA plan (about 20.2 GiB) on an 18 GiB card: more than the card, less than it once the plan's
    measured error (20%) is taken off. Before: refused, although the plan is an estimate checked on CPU only."""
    monkeypatch.chdir(REPO)
    _fake_gpu(monkeypatch, 18)
    with caplog.at_level(logging.WARNING, logger="vision_grpo.plan"):
        plan = plan_check.check_before_training(*_recipe("recipes/geoqa/qwen3_vl_4b_lora.yaml"))
    assert plan.total() > 18 * GiB and plan.verdict(18 * GiB) == "may not fit"
    assert "has 18.0 GiB: within the plan's error (+-20%, measured on CPU) it may not fit" in caplog.text
    assert "`memory_plan_check: false` skips this check" in caplog.text


def test_a_plan_within_the_gpu_or_with_the_check_off_passes(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    _fake_gpu(monkeypatch, 141)
    assert plan_check.check_before_training(*_recipe("recipes/geoqa/qwen3_5_4b_lora.yaml")) is not None
    _fake_gpu(monkeypatch, 16)
    args = _recipe("recipes/geoqa/qwen3_5_4b_lora.yaml", "--memory_plan_check", "false")
    assert plan_check.check_before_training(*args).total() > 16 * GiB


def _parts(recipe: str, *overrides: str) -> dict[str, float]:
    from vision_grpo.plan.check import recipe_plan

    plan, _ = recipe_plan(["--config", recipe, *overrides])
    return {part.name.split(" (")[0]: part.bytes for part in plan.parts}


def test_the_packed_pass_is_planned_from_its_tokens_and_the_decode_cache_once_per_prompt(monkeypatch) -> None:
    """GeoQA, Qwen3-VL-4B: 8 rows of 1,217 prompt + 1,024 completion tokens on TRL's pass; one packed row of the
    prompt and 8 x (1 + 279) tokens; its 64 rows' prompt cache held once per prompt (8) while decoding."""
    monkeypatch.chdir(REPO)
    recipe = "recipes/geoqa/qwen3_vl_4b_lora.yaml"
    packed, per_copy = _parts(recipe), _parts(recipe, "--share_prompt_in_training", "false")
    activations = "activations"
    assert packed[activations] / per_copy[activations] == pytest.approx((1217 + 8 * 280) / (8 * (1217 + 1024)))
    longer = _parts(recipe, "--expected_completion_length", "1024")
    assert longer[activations] / packed[activations] == pytest.approx((1217 + 8 * 1025) / (1217 + 8 * 280))
    assert "packed rows' block mask" in packed and "packed rows' block mask" not in per_copy
    copies = _parts(recipe, "--share_decode_cache", "false")
    assert copies["generation cache, prompts"] == pytest.approx(8 * packed["generation cache, prompts"])
    assert "decode: one layer's prompt cache expanded to its rows" not in copies


def test_dynamic_sampling_is_planned_per_generate_call_and_its_extra_generation_estimated(monkeypatch) -> None:
    from vision_grpo.plan.check import recipe_plan

    monkeypatch.chdir(REPO)
    recipe = ["--config", "recipes/geoqa/qwen3_5_4b_lora.yaml", "--dead_group_share", "0.33"]
    plain, _ = recipe_plan(recipe)
    sampled, _ = recipe_plan([*recipe, "--dynamic_sampling_rounds", "3"])
    assert [(p.name, p.bytes) for p in sampled.parts] == [(p.name, p.bytes) for p in plain.parts]
    assert plain.notes == [] and len(sampled.notes) == 1
    # 0.33 missing, then 0.33 of those, then 0.33 of those: 0.33 + 0.109 + 0.036 of a batch
    assert "47% more groups generated on average, in 3 call(s) at most" in sampled.notes[0]
