"""The embedded tiny Qwen2.5-VL: built deterministically, loaded offline through the recipes' loaders, and its prompts
hold exactly the image tokens the processor computes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from trl import ModelConfig

from vision_grpo.config import TaskArguments
from vision_grpo.data import get_dataset
from vision_grpo.modeling import TINY_MODEL, get_processor, load_model, max_pixels_of
from vision_grpo.tiny_model import build_tiny_vlm
from vision_grpo.training import VisualTokenMismatch, check_visual_tokens

QUESTION = "How many circles are in the image?"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def model_args(tiny_model_path: Path) -> ModelConfig:
    return ModelConfig(model_name_or_path=TINY_MODEL, dtype="float32")


@pytest.fixture
def processor(model_args: ModelConfig):
    return get_processor(model_args, TaskArguments())


def test_building_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    first, again, other = (build_tiny_vlm(tmp_path / name, seed=s) for name, s in (("a", 0), ("b", 0), ("c", 1)))
    first_weights, again_weights = weights(first), weights(again)
    assert first_weights.keys() == again_weights.keys()
    assert all(torch.equal(first_weights[k], again_weights[k]) for k in first_weights)
    assert (first / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert not all(torch.equal(first_weights[k], weights(other)[k]) for k in first_weights)
    assert not (tmp_path / "a.partial").exists()


def test_loads_offline_through_the_recipe_loaders(model_args: ModelConfig, processor) -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model = load_model(model_args)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.config.image_token_id == processor.image_token_id
    assert processor.tokenizer.padding_side == "left"


def test_a_140px_image_becomes_25_image_tokens(processor) -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.new("RGB", (140, 140), "white")], return_tensors="pt")
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 25
    assert inputs["image_grid_thw"].tolist() == [[1, 10, 10]]  # 10x10 patches, merged 2x2


@pytest.mark.parametrize(
    "image_part", [{"type": "image"}, {"type": "image", "text": None}], ids=["plain", "datasets-form"]
)
def test_the_chat_template_renders_image_and_text_parts(processor, image_part: dict) -> None:
    messages = [{"role": "user", "content": [image_part, {"type": "text", "text": QUESTION}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    text_only = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "2"}]
    assert processor.apply_chat_template(text_only, tokenize=False) == (
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
    )


@pytest.fixture
def dataset(processor):
    task = TaskArguments(shapes_train_size=3, shapes_canvas=256)
    return get_dataset(task, "train", max_pixels_of(processor))


def test_the_visual_token_check_passes_on_a_real_dataset(dataset, processor) -> None:
    assert check_visual_tokens(dataset, processor, samples=-1, chat_template_kwargs={}) == len(dataset)


def test_pixel_limits_that_disagree_with_the_rendered_prompt_are_caught(dataset, processor) -> None:
    """Qwen's docs suggest setting `image_processor.max_pixels`; it changes the images' tokens but not `size`."""
    processor.image_processor.max_pixels = (3 * 28) ** 2
    with pytest.raises(VisualTokenMismatch, match="image tokens"):
        check_visual_tokens(dataset, processor, samples=1, chat_template_kwargs={})


def test_a_chat_template_with_two_image_pads_is_refused(dataset, processor) -> None:
    processor.chat_template = processor.chat_template.replace("<|image_pad|>", "<|image_pad|><|image_pad|>")
    with pytest.raises(ValueError, match="image_pad"):
        check_visual_tokens(dataset, processor, samples=1, chat_template_kwargs={})
