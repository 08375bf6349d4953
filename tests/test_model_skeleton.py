"""The HF model without weights (`model_skeleton`, the vLLM backend's only HF model) decides what the loaded model
decides: the same stop ids from the checkpoint's generation config (Qwen3.5's replica ships none, like the real
model), the same parameters, and the same verdict on an adapter that fits, one with renamed keys and one of another
base."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lora_runs import lora_run
from safetensors.torch import load_file, save_file
from trl import ModelConfig

from vision_grpo.evaluation.adapters import AdapterMismatch, load_verified_adapter, model_skeleton
from vision_grpo.evaluation.evaluator import Evaluator
from vision_grpo.models.embedded import EMBEDDED_FAMILIES, resolve_model_path
from vision_grpo.models.loading import get_processor, load_model

RECIPE = "recipes/shapes/tiny_cpu.yaml"


def loaded(name: str):
    return load_model(ModelConfig(model_name_or_path=name, dtype="float32"))


def skeleton(name: str):
    return model_skeleton(resolve_model_path(name))


@pytest.mark.parametrize("name", list(EMBEDDED_FAMILIES))
def test_the_skeleton_has_the_loaded_models_parameters_and_stop_ids_and_no_weights(name: str) -> None:
    empty, full = skeleton(name), loaded(name)
    assert {n: p.shape for n, p in empty.named_parameters()} == {n: p.shape for n, p in full.named_parameters()}
    assert all(p.is_meta for p in empty.parameters())
    assert empty.generation_config.to_diff_dict() == full.generation_config.to_diff_dict()
    processor = get_processor(ModelConfig(model_name_or_path=name), _NoPixels())
    stop_ids = lambda model: Evaluator(model, processor, "shapes", [], {}).stop_ids  # noqa: E731
    assert stop_ids(empty) == stop_ids(full)


class _NoPixels:
    min_pixels = max_pixels = None


def _renamed(adapter: Path, folder: Path) -> Path:
    """The adapter with its second layer's keys renamed: those weights attach to nothing."""
    folder.mkdir()
    shutil.copy(adapter / "adapter_config.json", folder)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    save_file(
        {k.replace("layers.1.", "blocks.1."): v for k, v in weights.items()}, str(folder / "adapter_model.safetensors")
    )
    return folder


@pytest.mark.parametrize("name", list(EMBEDDED_FAMILIES))
def test_an_adapter_is_verified_on_the_skeleton_as_on_the_loaded_model(name: str, tmp_path: Path) -> None:
    adapter = lora_run(tmp_path / "run", name, RECIPE)
    for model in (skeleton(name), loaded(name)):
        load_verified_adapter(model, adapter)
    renamed = _renamed(adapter, tmp_path / "renamed")
    for model in (skeleton(name), loaded(name)):
        with pytest.raises(AdapterMismatch, match=r"adapter weights .* did not attach.*blocks\.1\."):
            load_verified_adapter(model, renamed)
    other = next(family for family in EMBEDDED_FAMILIES if family != name)
    for model in (skeleton(other), loaded(other)):
        with pytest.raises(AdapterMismatch, match="does not fit the base model|did not attach"):
            load_verified_adapter(model, adapter)


def test_a_skeleton_cannot_be_merged(tmp_path: Path) -> None:
    name = next(iter(EMBEDDED_FAMILIES))
    with pytest.raises(ValueError, match="cannot be merged into a model without weights"):
        load_verified_adapter(skeleton(name), lora_run(tmp_path / "run", name, RECIPE), merge=True)
