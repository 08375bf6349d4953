"""Each distinct prompt prefilled once in HF generation (vision_grpo/models/shared_prefill.py): the same completions
as the per-copy `generate` for the same seed, in every family, with a fraction of the prefill's tokens; rows that
only look alike are never merged; a cache it does not know falls back with one warning.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import FAMILY_MODELS
from PIL import Image
from trl import ModelConfig

from vision_grpo.models import shared_prefill
from vision_grpo.models.loading import get_processor, load_model
from vision_grpo.models.shared_prefill import copy_runs, share_prefill
from vision_grpo.recipe.arguments import TaskArguments

G = 4
SAMPLING = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}


def _image(height: int, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, 96, 3, generator=generator) * 255).byte().numpy())


def _model_and_inputs(name: str) -> tuple[torch.nn.Module, dict]:
    """G copies each of three prompts, as TRL passes them: two share their text but not their image, one is longer
    (so the others are left-padded)."""
    args = ModelConfig(model_name_or_path=name, dtype="float32")
    model, processor = load_model(args).eval(), get_processor(args, TaskArguments())

    def prompt(text: str) -> str:
        content = [{"type": "image"}, {"type": "text", "text": text}]
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

    texts = [prompt("How many?")] * G + [prompt("Count the shapes, please.")] * G + [prompt("How many?")] * G
    images = [_image(64, 0)] * G + [_image(80, 1)] * G + [_image(96, 2)] * G
    return model, processor(text=texts, images=images, return_tensors="pt", padding=True)


def _generate(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, int]:
    """Completions for seed 1, and the tokens the language model's forwards were given (prefill and decoding)."""
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda _, args, out: seen.append(args[0].numel()))
    torch.manual_seed(1)
    sequences = model.generate(**inputs, **SAMPLING)
    hook.remove()
    return sequences, sum(seen)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_shared_prefill_samples_the_per_copy_completions_from_fewer_tokens(name: str) -> None:
    model, inputs = _model_and_inputs(name)
    per_copy, per_copy_tokens = _generate(model, inputs)
    shared = share_prefill(model)
    once, once_tokens = _generate(model, inputs)

    assert shared.fallback is None
    assert torch.equal(per_copy, once)
    assert len({tuple(row.tolist()) for row in once}) > 3  # the copies sampled different completions
    rows, length = inputs["input_ids"].shape
    decoded = per_copy_tokens - rows * length
    # 3 prompts prefilled (all but their last token), then every row's last prompt token, then the same decoding
    assert once_tokens == 3 * (length - 1) + rows + decoded


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_the_decode_cache_holds_each_prompt_once_and_samples_the_same(name: str) -> None:
    """3 prompts x G rows: the full-attention layers keep the prompts' keys and values once, each row only its
    completion's; `share_cache=False` keeps a copy per row, with the same completions."""
    model, inputs = _model_and_inputs(name)

    def cached(share: bool) -> tuple[torch.Tensor, int, int]:
        share_prefill(model, share_cache=share)
        torch.manual_seed(1)
        out = model.generate(**inputs, **SAMPLING, return_dict_in_generate=True)
        layers = [layer for layer in out.cache.layers if hasattr(layer, "keys") and layer.keys is not None]
        stored = sum(t.numel() for layer in layers for t in vars(layer).values() if isinstance(t, torch.Tensor))
        return out.sequences, stored, len(layers)

    copied, copied_elements, layers = cached(False)
    shared, shared_elements, _ = cached(True)
    assert torch.equal(copied, shared)
    rows, prompt = inputs["input_ids"].shape
    decoded = copied.shape[1] - prompt
    # per full-attention layer: keys and values of [rows, heads, prompt + decoded - 1, head size] when copied;
    # of 3 prompts' [prompt - 1] and the rows' own [decoded] when shared (the row index aside)
    per_position = copied_elements / (layers * rows * (prompt + decoded - 1))
    expected = layers * per_position * (3 * (prompt - 1) + rows * decoded) + layers * rows
    assert shared_elements == pytest.approx(expected)
    assert shared_elements < copied_elements / 2


@pytest.mark.parametrize("rows", [[0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 1, 0]])
def test_a_shared_prefix_layer_gives_each_row_its_prompt_then_its_own_tokens(rows: list[int]) -> None:
    """Runs of consecutive copies (TRL's layout, one broadcast copy) and rows in any order (a gather) alike."""
    keys, values = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    layer = shared_prefill.SharedPrefixLayer(keys, values, torch.tensor(rows))
    assert layer.copies == (3 if rows == sorted(rows) else 0)
    for step in range(2):
        new_keys, new_values = torch.randn(6, 3, 1, 4), torch.randn(6, 3, 1, 4)
        got_keys, got_values = layer.update(new_keys, new_values)
        assert layer.get_seq_length() == 5 + step + 1
    assert torch.equal(got_keys[:, :, :5], keys[rows]) and torch.equal(got_values[:, :, :5], values[rows])
    assert torch.equal(got_keys[:, :, -1:], new_keys) and torch.equal(got_values[:, :, -1:], new_values)
    layer.batch_select_indices(torch.tensor([5, 0]))
    assert layer.rows.tolist() == [rows[5], rows[0]] and layer.copies == 0
    assert torch.equal(layer.update(new_keys[:2], new_values[:2])[0][:, :, :5], keys[[rows[5], rows[0]]])


def test_rows_count_as_copies_only_next_to_each_other_and_bit_identical() -> None:
    ids = torch.tensor([[5, 6], [5, 6], [5, 6], [5, 7], [5, 6]])
    pixels = torch.rand(5 * 4, 3)
    pixels[8:12] = pixels[0:4]  # row 2's image equals row 0's ...
    pixels[8, 0] = torch.nextafter(pixels[8, 0], torch.tensor(2.0))  # ... but for one bit
    pixels[4:8] = pixels[0:4]
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": torch.tensor([[1, 0]] * 5),
        "image_grid_thw": torch.tensor([[1, 2, 2]] * 5),
        "pixel_values": pixels,
    }
    runs, layout = copy_runs(inputs, merge=4)  # each 2 x 2 grid is one image token, as mm_token_type_ids says
    assert layout == [[0], [1], [2], [3], [4]]
    assert runs.rows == [0, 0, 1, 2, 3]  # one bit apart, other ids, and a copy not next to its first stay apart


def test_a_cache_it_does_not_know_keeps_the_per_copy_generate_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model, inputs = _model_and_inputs(FAMILY_MODELS[0])
    per_copy, _ = _generate(model, inputs)
    monkeypatch.setattr(shared_prefill, "COPYABLE_LAYERS", {})  # as a new cache layer class would be
    shared = share_prefill(model)
    with caplog.at_level(logging.WARNING, logger="vision_grpo.models.shared_prefill"):
        first, _ = _generate(model, inputs)
        second, _ = _generate(model, inputs)
    assert torch.equal(first, per_copy) and torch.equal(second, per_copy)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "prefill sharing off: a cache layer it does not know (DynamicLayer); every copy is "
        "prefilled on its own from now on"
    ]
    assert shared.fallback is not None


def test_while_dropout_is_active_every_copy_is_prefilled() -> None:
    """TRL samples in training mode: with LoRA dropout the copies must each draw their own mask, so no sharing."""
    model, inputs = _model_and_inputs(FAMILY_MODELS[0])
    model.model.language_model.layers[0].mlp.down_proj = torch.nn.Sequential(
        torch.nn.Dropout(0.05), model.model.language_model.layers[0].mlp.down_proj
    )
    model.train()
    torch.manual_seed(1)
    per_copy = model.generate(**inputs, **SAMPLING)
    share_prefill(model)
    _, tokens = _generate(model, inputs)
    assert tokens == inputs["input_ids"].numel() + (per_copy.shape[1] - inputs["input_ids"].shape[1] - 1) * 12
