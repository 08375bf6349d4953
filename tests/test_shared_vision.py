"""Each distinct image through the vision tower once (vision_grpo/models/shared_vision.py): which images count as the
same, the same log-probs and gradients as the per-copy path for every family (trainable tower and LoRA on it
included), the fallback for outputs it cannot split, the frozen tower's features reused within a step, and a real
training run that gives the same weights with sharing on and off.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import FAMILY_MODELS, run_script
from peft import get_peft_model
from PIL import Image
from recording.recorder import RECORD_ENV, read_records, recorded_training_args
from trl import ModelConfig

from vision_grpo.models.loading import get_processor, load_model
from vision_grpo.models.lora import get_peft_config
from vision_grpo.models.shared_vision import distinct_images, share_vision_tower
from vision_grpo.recipe.arguments import TaskArguments

# 5 image slots, 2 distinct images: two copies of one prompt, a row without an image, a two-image row (one of them
# repeated from the first rows) and another row, as GRPO's repeated prompts and multi-image rows give.
ROW_IMAGES = [["a"], ["a"], [], ["b", "a"], ["b"]]
BOUND = 1e-5  # float32 round-off of a different summation order; measured: 0 for log-probs, <= 7.2e-7 for gradients


def _image(height: int, width: int, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=generator) * 255).byte().numpy())


def _model_and_batch(name: str, vision: str) -> tuple[torch.nn.Module, dict]:
    args = ModelConfig(model_name_or_path=name, dtype="float32", use_peft=vision == "lora", lora_r=4)
    model = load_model(args)
    if vision == "lora":
        model = get_peft_model(model, get_peft_config(args, TaskArguments(lora_on_vision=True)))
    else:
        model.requires_grad_(True)
    model.eval()  # LoRA's dropout off: its masks are random, and per image slot (so never the same in both paths)
    processor = get_processor(args, TaskArguments())
    images = {"a": _image(64, 96, 0), "b": _image(80, 64, 1)}
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}] * len(row) + [{"type": "text", "text": "How many?"}]}],
            add_generation_prompt=True,
        )
        + "Three."
        for row in ROW_IMAGES
    ]
    flat = [images[key] for row in ROW_IMAGES for key in row]
    return model, processor(text=texts, images=flat, return_tensors="pt", padding=True)


def _log_probs_and_gradients(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(**batch).logits
    log_probs = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["attention_mask"][:, 1:]
    (-(log_probs * mask).sum() / mask.sum()).backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach() * mask, gradients


@pytest.mark.parametrize("vision", ["train", "lora"])
@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_shared_tower_gives_the_per_copy_log_probs_and_gradients(name: str, vision: str) -> None:
    model, batch = _model_and_batch(name, vision)
    per_copy = _log_probs_and_gradients(model, batch)
    (shared,) = share_vision_tower(model)
    assert shared.cache is None  # a trainable tower: nothing is kept between forwards
    once = _log_probs_and_gradients(model, batch)

    assert (shared.slots, shared.encoded, shared.calls) == (5, 2, 1)
    assert (per_copy[0] - once[0]).abs().max() <= BOUND
    assert per_copy[1].keys() == once[1].keys()
    vision_gradients = [key for key in per_copy[1] if "visual" in key and per_copy[1][key].abs().max() > 0]
    assert vision_gradients  # the tower's parameters really got gradients through the shared features
    for key, gradient in per_copy[1].items():
        assert (gradient - once[1][key]).abs().max() <= BOUND, key


def test_only_bit_identical_pixels_on_the_same_grid_count_as_one_image() -> None:
    generator = torch.Generator().manual_seed(0)
    image = torch.rand(8, 12, generator=generator)
    permuted = image.flip(0)  # the same bits in another order: the fingerprint (a sum) collides, the pixels differ
    nudged = image.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(2.0))
    pixels = torch.cat([image, image, permuted, image, nudged])
    grids = torch.tensor([[1, 2, 4], [1, 2, 4], [1, 2, 4], [1, 4, 2], [1, 2, 4]])
    distinct = distinct_images(pixels, grids)
    assert distinct.keys[0][1] == distinct.keys[1][1]  # a real collision of fingerprints...
    assert distinct.inverse == [0, 0, 1, 2, 3]  # ...never merges; nor does another grid, nor one bit of difference


def test_an_output_it_cannot_split_falls_back_to_the_per_copy_features_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, batch = _model_and_batch(FAMILY_MODELS[0], "train")
    expected = _log_probs_and_gradients(model, batch)[0]
    (shared,) = share_vision_tower(model)
    real = shared.forward

    def with_a_summary(hidden_states, grid_thw, **kwargs):  # a new family's tower: one extra vector per call
        output = real(hidden_states, grid_thw, **kwargs)
        output["summary"] = output.pooler_output.mean(0, keepdim=True)
        return output

    shared.forward = with_a_summary
    with caplog.at_level(logging.WARNING, logger="vision_grpo.models.shared_vision"):
        first = _log_probs_and_gradients(model, batch)[0]
        second = _log_probs_and_gradients(model, batch)[0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "a tensor of shape (1, " in warnings[0] and "per-copy" in warnings[0]
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert (shared.slots, shared.encoded) == (5 + 5, 2 + 5 + 5)  # the failed shared try, then every slot on its own


def test_a_tower_it_does_not_know_keeps_the_per_copy_path_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    class NewTower(torch.nn.Module):
        def forward(self, hidden_states, grid_thw):
            return hidden_states

    model = torch.nn.ModuleDict({"visual": NewTower(), "language_model": torch.nn.Linear(2, 2)})
    with caplog.at_level(logging.WARNING, logger="vision_grpo.models.shared_vision"):
        assert share_vision_tower(model) == []
    assert "visual (NewTower) is not a tower it knows" in caplog.text
    assert share_vision_tower(torch.nn.Linear(2, 2)) == []  # no tower at all: nothing to share, nothing to say


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_a_frozen_tower_encodes_each_image_once_per_step(name: str) -> None:
    model, batch = _model_and_batch(name, "train")
    model.model.visual.requires_grad_(False)
    per_copy = _log_probs_and_gradients(model, batch)
    (shared,) = share_vision_tower(model)
    shared.cache.active = True  # the trainer's StepScopedFeatures does this at a step's start
    passes = [_log_probs_and_gradients(model, batch) for _ in range(3)]  # generation, reference, policy
    assert shared.calls == 1 and shared.encoded == 2
    for log_probs, gradients in passes:
        assert torch.equal(log_probs, per_copy[0])
        assert all(torch.equal(gradients[key], per_copy[1][key]) for key in per_copy[1])
    shared.cache.clear()  # the step's end
    _log_probs_and_gradients(model, batch)
    assert shared.calls == 2


def test_features_kept_by_a_pass_with_gradients_serve_the_next_pass_backward() -> None:
    """With vLLM the step's first forward through the model can be a training micro-batch: its features, kept for
    the next micro-batch, must not carry the graph that the first backward frees (activation checkpointing makes
    the frozen tower's patch embedding require grad)."""
    model, batch = _model_and_batch(FAMILY_MODELS[0], "train")
    model.model.visual.requires_grad_(False)
    model.enable_input_require_grads()  # as the Trainer does for activation checkpointing
    (shared,) = share_vision_tower(model)
    shared.cache.active = True
    first, second = (_log_probs_and_gradients(model, batch) for _ in range(2))
    assert shared.calls == 1
    assert torch.equal(first[0], second[0])


def _train(tmp_path: Path, share: bool) -> tuple[dict, str]:
    records = tmp_path / f"records-{share}"
    records.mkdir()
    # No LoRA dropout: with it the per-copy prefill draws a mask per copy, and the shared prefill is not used. TRL's
    # per-copy training pass, so that the tower sees every copy there (the packed pass hands it each image once).
    trl_pass = [
        "--share_prompt_in_training",
        "false",
        "--balance_micro_batches",
        "false",
        "--skip_zero_advantage",
        "false",
    ]
    args = recorded_training_args(
        tmp_path / f"run-{share}", "--share_prompt_copies", str(share).lower(), "--lora_dropout", "0", *trl_pass
    )
    process = run_script(args, timeout=600, env={RECORD_ENV: str(records)})
    return read_records(records, "step")[-1]["checksums"], process.stderr


def test_training_with_sharing_gives_the_weights_of_the_per_copy_path(tmp_path: Path) -> None:
    """2 GRPO steps of the tiny recipe (HF generation, frozen tower, G = 4): each image encoded and each prompt
    prefilled once, bit-identical weights, and the log says what it shared."""
    shared, log = _train(tmp_path, True)
    per_copy, per_copy_log = _train(tmp_path, False)
    assert shared == per_copy
    said = re.search(r"vision sharing: (\d+) image slots, (\d+) distinct images", log)
    slots, encoded = map(int, said.groups())
    assert slots == 4 * encoded  # the recipe's G = 4 copies of each prompt, each image encoded once
    prefilled = re.search(r"prefill sharing: (\d+) prompts prefilled once for (\d+) rows", log)
    prompts, rows = map(int, prefilled.groups())
    assert rows == 4 * prompts
    assert "vision sharing" not in per_copy_log and "prefill sharing" not in per_copy_log
