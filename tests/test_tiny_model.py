"""The embedded replicas of Qwen2.5-VL, Qwen3-VL and Qwen3.5: built deterministically, faithful to their family
(architecture, config features, TRL's real chat template, processor, special tokens), loaded offline through the
recipes' loaders; and the visual-token check that compares prompts with what the model will consume."""

from __future__ import annotations

import json
import logging
import os
import unicodedata
from pathlib import Path

import pytest
import torch
import trl
from conftest import FAMILY_MODELS
from peft import get_peft_model
from PIL import Image
from safetensors.torch import load_file
from tokenizers import Tokenizer, normalizers
from transformers import AutoConfig
from transformers.utils import is_torchvision_available
from trl import ModelConfig

from vision_grpo.data import get_dataset
from vision_grpo.data.geoqa_fixture import fixture_rows
from vision_grpo.models import processing
from vision_grpo.models.embedded import resolve_model_path
from vision_grpo.models.loading import get_processor, load_model, max_pixels_of
from vision_grpo.models.lora import get_peft_config
from vision_grpo.models.replicas.build import build_replica
from vision_grpo.models.replicas.families import FAMILIES
from vision_grpo.models.visual_tokens import VisualTokenMismatch, check_visual_tokens
from vision_grpo.recipe.arguments import TaskArguments

QUESTION = "How many circles are in the image?"
# What each replica must be: the class transformers maps its config to, the processor class, and the file of the
# chat template TRL ships (and recognises by exact string equality), read from TRL's package, not from the builder.
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
EXPECTED = {
    "vision-grpo/tiny-qwen2.5-vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", "qwen2_5_vl.jinja"),
    "vision-grpo/tiny-qwen3-vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "qwen3_vl.jinja"),
    "vision-grpo/tiny-qwen3.5": ("Qwen3_5ForConditionalGeneration", "Qwen3VLProcessor", "qwen3_5_think.jinja"),
}
# Image tokens for a 140x140 image: 10x10 patches of 14 px merged 2x2 (Qwen2.5-VL), 8x8 of 16 px (Qwen3 families).
TOKENS_140PX = {"vision-grpo/tiny-qwen2.5-vl": 25, "vision-grpo/tiny-qwen3-vl": 16, "vision-grpo/tiny-qwen3.5": 16}
# LoRA targets on the language model: Qwen3.5's Gated DeltaNet layers have their own projections.
LINEAR_ATTENTION = {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}
FULL_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def model_args(name: str, **extra) -> ModelConfig:
    return ModelConfig(model_name_or_path=name, dtype="float32", **extra)


def messages() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(params=FAMILY_MODELS)
def name(request) -> str:
    return request.param


@pytest.fixture
def processor(name: str):
    return get_processor(model_args(name), TaskArguments())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_building_is_deterministic_for_a_seed(family: str, tmp_path: Path) -> None:
    first, again, other = (build_replica(family, tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    first_weights, again_weights = weights(first), weights(again)
    assert first_weights.keys() == again_weights.keys()
    assert all(torch.equal(first_weights[k], again_weights[k]) for k in first_weights)
    assert (first / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert not all(torch.equal(first_weights[k], weights(other)[k]) for k in first_weights)
    assert not (tmp_path / "a.partial").exists()


def test_each_replica_loads_offline_as_its_family(name: str, processor) -> None:
    model_class, processor_class, template_file = EXPECTED[name]
    template = (TRL_TEMPLATES / template_file).read_text(encoding="utf-8")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model = load_model(model_args(name))
    assert type(model).__name__ == model_class
    assert type(processor).__name__ == processor_class
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert processor.chat_template == template  # TRL recognises templates by exact string equality
    assert model.config.image_token_id == processor.image_token_id
    assert processor.tokenizer.padding_side == "left"
    folder = Path(resolve_model_path(name))
    for filename in ("config.json", "model.safetensors", "chat_template.jinja"):
        assert (folder / filename).is_file(), filename
    # Qwen3.5's Hub repositories ship no generation_config.json; the other two families' do.
    assert (folder / "generation_config.json").is_file() == (name != "vision-grpo/tiny-qwen3.5")
    assert (folder / "chat_template.jinja").read_text(encoding="utf-8") == template
    for filename in ("processor_config.json", "tokenizer_config.json"):
        assert json.loads((folder / filename).read_text())["processor_class"] == processor_class
    # The image processor's own file too, as Hub checkpoints ship it: where torchvision is installed, transformers
    # builds the video processor the saved config lacks from it (vLLM's and lmms-eval's AutoProcessor).
    nested = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    assert json.loads((folder / "preprocessor_config.json").read_text())["size"] == nested["size"]


@pytest.mark.skipif(is_torchvision_available(), reason="the full processor loads where torchvision is installed")
def test_without_torchvision_the_image_only_processor_is_said_once_in_one_short_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: at every load, an INFO line of 400 characters quoting transformers' error ("Can't load video processor
    for ... make sure you don't have a local directory with the same name"), read as a failure."""
    processing._say_image_only.cache_clear()
    with caplog.at_level(logging.DEBUG, logger="vision_grpo.models.processing"):
        for name in FAMILY_MODELS:
            get_processor(model_args(name), TaskArguments())
    said = [r for r in caplog.records if r.name == "vision_grpo.models.processing"]
    assert [(r.levelname, r.getMessage()) for r in said] == [
        ("INFO", "no torchvision here: processors load without their video part (these recipes use images only)")
    ]


def test_special_tokens_have_qwens_names_and_roles(name: str, processor) -> None:
    tokenizer = processor.tokenizer
    config = load_model(model_args(name)).config
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer.convert_tokens_to_ids
    assert config.image_token_id == ids("<|image_pad|>") and config.video_token_id == ids("<|video_pad|>")
    assert config.vision_start_token_id == ids("<|vision_start|>")
    assert config.vision_end_token_id == ids("<|vision_end|>")
    for token in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>"):
        assert tokenizer.decode([ids(token)], skip_special_tokens=True) == ""
    if name != "vision-grpo/tiny-qwen2.5-vl":  # Qwen3's think tags are added tokens that decoding keeps
        text = tokenizer.decode(tokenizer.encode("<think>\nhm\n</think>\n\n2"), skip_special_tokens=True)
        assert text == "<think>\nhm\n</think>\n\n2"
        assert len(tokenizer.encode("<think>")) == 1


def test_family_config_features() -> None:
    configs = {name: load_model(model_args(name)).config for name in FAMILY_MODELS}
    qwen2_5 = configs["vision-grpo/tiny-qwen2.5-vl"]
    assert qwen2_5.vision_config.patch_size == 14 and qwen2_5.vision_config.fullatt_block_indexes == [1]
    qwen3 = configs["vision-grpo/tiny-qwen3-vl"]
    assert qwen3.vision_config.patch_size == 16
    assert qwen3.text_config.rope_parameters["mrope_interleaved"] is True
    # Three deepstack features, as the real model's, each entering one of the first three language-model layers.
    deepstack = qwen3.vision_config.deepstack_visual_indexes
    assert len(deepstack) == 3 and all(0 <= i < qwen3.vision_config.depth for i in deepstack)
    assert qwen3.text_config.num_hidden_layers >= len(deepstack)
    qwen3_5 = configs["vision-grpo/tiny-qwen3.5"]
    assert qwen3_5.vision_config.patch_size == 16
    # The real 3:1 pattern: every fourth layer full attention, the others Gated DeltaNet; at least one full cycle.
    layer_types = qwen3_5.text_config.layer_types
    assert len(layer_types) >= 4
    assert layer_types == [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(len(layer_types))
    ]
    for config in (qwen3, qwen3_5):  # learned vision position embeddings on the real 48 x 48 grid
        assert config.vision_config.num_position_embeddings == 48 * 48
    for config in configs.values():  # the rotary sections cover exactly the rotated half of a head
        text = config.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        rotary = int(head_dim * text.rope_parameters.get("partial_rotary_factor", 1.0))
        assert sum(text.rope_parameters["mrope_section"]) == rotary // 2


def test_qwen2_5_vl_is_saved_flat_with_a_padded_vocabulary_as_on_the_hub() -> None:
    """The Hub's Qwen2.5-VL config.json is the flat form (text keys at the top, `rope_scaling` of type mrope) that
    transformers converts on load, and its vocabulary (151,936) is larger than the tokenizer's (151,665)."""
    folder = Path(resolve_model_path("vision-grpo/tiny-qwen2.5-vl"))
    saved = json.loads((folder / "config.json").read_text())
    assert "text_config" not in saved and "rope_parameters" not in saved
    assert saved["rope_scaling"]["type"] == "mrope" and saved["hidden_size"] == 128
    config = AutoConfig.from_pretrained(folder)  # the conversion from the flat form
    assert config.text_config.hidden_size == 128 and config.text_config.num_hidden_layers == 2
    assert config.text_config.rope_parameters["mrope_section"] == saved["rope_scaling"]["mrope_section"]
    assert config.text_config.rope_parameters["rope_theta"] == saved["rope_theta"]
    assert config.tie_word_embeddings is True
    model = load_model(model_args("vision-grpo/tiny-qwen2.5-vl"))
    rows = model.get_input_embeddings().weight.shape[0]
    tokenizer = get_processor(model_args("vision-grpo/tiny-qwen2.5-vl"), TaskArguments()).tokenizer
    assert rows == config.text_config.vocab_size > len(tokenizer) and rows % 128 == 0
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("name", ["vision-grpo/tiny-qwen3.5"])
def test_qwen3_5_loads_its_own_tokenizer_class_and_keeps_geoqa_text(name: str, processor) -> None:
    """Qwen3.5's tokenizer_config.json names `Qwen2Tokenizer`, which transformers replaces by `Qwen3_5Tokenizer`
    (NFC normaliser, own split regex). GeoQA's Chinese, full-width punctuation and formulas must come back as
    written: NFC keeps full-width `（）` and `，` (NFKC would turn them into ASCII), and composes a decomposed `é`."""
    folder = Path(resolve_model_path(name))
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    tokenizer = processor.tokenizer
    assert type(tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert isinstance(tokenizer.backend_tokenizer.normalizer, normalizers.NFC)
    trained = Tokenizer.from_file(str(folder / "tokenizer.json"))  # the pieces the merges were learnt on
    texts = [row["subject"].strip() for row in fixture_rows(train_rows=12, test_rows=0, val_rows=0)]
    texts += ["如图，在Rt△ABC中，∠C=90°，AC=3，BC=4，则AB的长为（）", "\\boxed{B} ⊙O∥√3≈1.73 café"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, text
        assert ids == trained.encode(text, add_special_tokens=False).ids, text
    assert tokenizer.encode(unicodedata.normalize("NFD", "café")) == tokenizer.encode("café")
    assert [tokenizer.decode([i]) for i in tokenizer.encode("AB=120")][-3:] == ["1", "2", "0"]


def test_generation_prompts_render_as_the_family_does(name: str, processor) -> None:
    rendered = processor.apply_chat_template(messages(), add_generation_prompt=True, tokenize=False)
    user = f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|im_end|>\n"
    expected = {
        "vision-grpo/tiny-qwen2.5-vl": f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{user}"
        "<|im_start|>assistant\n",
        "vision-grpo/tiny-qwen3-vl": f"{user}<|im_start|>assistant\n",
        "vision-grpo/tiny-qwen3.5": f"{user}<|im_start|>assistant\n<think>\n",
    }
    assert rendered == expected[name]
    no_thinking = processor.apply_chat_template(
        messages(), add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    if name == "vision-grpo/tiny-qwen3.5":  # the seed's setting renders an empty think block
        assert no_thinking == f"{user}<|im_start|>assistant\n<think>\n\n</think>\n\n"
    else:
        assert no_thinking == rendered


def test_a_140px_image_becomes_the_familys_image_tokens(name: str, processor) -> None:
    text = processor.apply_chat_template(messages(), add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.new("RGB", (140, 140), "white")], return_tensors="pt")
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == TOKENS_140PX[name]


def test_lora_adapts_every_language_projection_and_nothing_in_the_vision_tower(name: str) -> None:
    args = model_args(name, use_peft=True, lora_r=4)
    model = get_peft_model(load_model(args), get_peft_config(args, TaskArguments()))
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted and not any("visual" in n for n in adapted)
    kinds = {n.rsplit(".", 1)[-1] for n in adapted}
    expected = FULL_ATTENTION | (LINEAR_ATTENTION if name == "vision-grpo/tiny-qwen3.5" else set())
    assert kinds == expected


@pytest.fixture
def dataset(processor):
    return get_dataset(TaskArguments(shapes_train_size=3, shapes_canvas=256), "train", max_pixels_of(processor))


@pytest.fixture
def model_config(name: str):
    return load_model(model_args(name)).config


def test_the_visual_token_check_passes_on_a_real_dataset(dataset, processor, model_config) -> None:
    checked = check_visual_tokens(dataset, processor, model_config, samples=-1, chat_template_kwargs={})
    assert checked == len(dataset)


def test_a_processor_of_another_family_is_caught_naming_the_row(dataset, model_config, name: str) -> None:
    other = "vision-grpo/tiny-qwen3.5" if name == "vision-grpo/tiny-qwen2.5-vl" else "vision-grpo/tiny-qwen2.5-vl"
    wrong = get_processor(model_args(other), TaskArguments())
    with pytest.raises(VisualTokenMismatch, match=r"example 1-0 .*another model family"):
        check_visual_tokens(dataset, wrong, model_config, samples=1, chat_template_kwargs={})


def test_a_merge_size_the_model_does_not_use_is_caught(dataset, processor, model_config) -> None:
    processor.image_processor.merge_size = 1  # 4x the image tokens of the model's 2x2 merge
    with pytest.raises(VisualTokenMismatch, match="vision tower produces"):
        check_visual_tokens(dataset, processor, model_config, samples=1, chat_template_kwargs={})


def test_pixel_limits_set_on_the_image_processor_attributes_are_caught(dataset, processor, model_config) -> None:
    """Qwen's docs suggest setting `image_processor.max_pixels`; it changes the images' tokens but not `size`.
    transformers warns of exactly this (the attribute reaches every call as the deprecated keyword): the user's
    mistake this test reproduces, not a call of ours."""
    processor.image_processor.max_pixels = (3 * 28) ** 2
    with (
        pytest.warns(FutureWarning, match="Passing `min_pixels` and `max_pixels` to a processor call is deprecated"),
        pytest.raises(VisualTokenMismatch, match="pixel limits"),
    ):
        check_visual_tokens(dataset, processor, model_config, samples=1, chat_template_kwargs={})


def test_recipe_pixel_limits_that_did_not_reach_the_processor_are_caught(dataset, processor, model_config) -> None:
    limits = (None, max_pixels_of(processor) // 4)  # the recipe asked for a quarter of what the processor allows
    with pytest.raises(VisualTokenMismatch, match="did not reach the image processor"):
        check_visual_tokens(dataset, processor, model_config, 1, {}, pixel_limits=limits)


@pytest.mark.parametrize("pads", [0, 2], ids=["no-image-slot", "two-image-pads"])
def test_a_chat_template_that_renders_the_image_wrongly_is_caught(dataset, processor, model_config, pads) -> None:
    processor.chat_template = processor.chat_template.replace("<|image_pad|>", "<|image_pad|>" * pads)
    with pytest.raises((VisualTokenMismatch, ValueError), match="image"):
        check_visual_tokens(dataset, processor, model_config, samples=1, chat_template_kwargs={})
