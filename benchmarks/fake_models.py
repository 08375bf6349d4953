"""Few-layer models at each family's real width for benchmarks/memory_plan.py: the shipped config with 1 or 2 decoder
layers (and vision blocks), built as the trainer builds it (TRL's fused head, PEFT LoRA) on fake tensors, and what
autograd keeps of a forward for backward (`SavedBytes`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from vision_grpo.models.vision import VISION_MODULE_PATTERN
from vision_grpo.plan import formulas as mf
from vision_grpo.plan.estimate import SHIPPED_CONFIGS

FAMILIES = {"Qwen2.5-VL-3B": "Qwen--Qwen2.5-VL-3B-Instruct", "Qwen3-VL-4B": "Qwen--Qwen3-VL-4B-Instruct"}
FAMILIES["Qwen3.5-4B"] = "Qwen--Qwen3.5-4B"
RANK = 32
MiB = 2**20


def few_layer_config(family: str, layer_types: list[str], vision_depth: int = 1, vocab: int | None = None) -> Any:
    """The family's real config with the given decoder layers (Qwen3.5 takes their types) and vision blocks."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(SHIPPED_CONFIGS / f"{FAMILIES[family]}.json")
    text, vision = config.get_text_config(), config.vision_config
    text.num_hidden_layers = len(layer_types)
    if getattr(text, "layer_types", None):
        text.layer_types = layer_types
    if vocab:
        text.vocab_size = vocab
    vision.depth = vision_depth
    if hasattr(vision, "fullatt_block_indexes"):
        vision.fullatt_block_indexes = list(range(vision_depth))
    if getattr(vision, "deepstack_visual_indexes", None):
        vision.deepstack_visual_indexes = []
    return config


def build(config: Any, mode: FakeTensorMode | None, lora_on_vision: bool = False) -> torch.nn.Module:
    """The model as the trainer builds it (TRL's fused head, then PEFT LoRA), on fake tensors under `mode` (or on
    real random ones when `mode` is None)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText
    from trl.trainer.utils import add_fused_lm_head

    lora = LoraConfig(
        r=RANK,
        lora_alpha=RANK,
        target_modules="all-linear",
        exclude_modules=None if lora_on_vision else VISION_MODULE_PATTERN,
    )
    if mode is None:
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        return get_peft_model(model, lora)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    model = get_peft_model(model, lora)
    with mode:
        mf.materialise_fake(model)
    return model


class SavedBytes:
    """Bytes autograd keeps for backward at the end of a forward, by the label of the module that saved them: each
    storage once, weights left out, and only storages still alive (a branch whose output is dropped frees its
    saved tensors, and its memory may be reused by a later one)."""

    def __init__(self, model: torch.nn.Module, labelled: dict[str, torch.nn.Module]) -> None:
        self.weights = {p.untyped_storage()._cdata for p in model.parameters()}
        self.saved: list[tuple[str, int, StorageWeakRef, int]] = []
        self.label = "other"
        for label, module in labelled.items():
            module.register_forward_pre_hook(lambda m, a, label=label: setattr(self, "label", label))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in self.weights:
            self.saved.append((self.label, storage._cdata, StorageWeakRef(storage), storage.nbytes()))
        return tensor

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield

    @property
    def by_label(self) -> dict[str, int]:
        """Call while the forward's output is alive (it holds the graph and so the saved tensors)."""
        alive: dict[int, tuple[str, int]] = {}
        for label, key, ref, size in self.saved:
            if not ref.expired():
                alive.setdefault(key, (label, size))
        totals: dict[str, int] = defaultdict(int)
        for label, size in alive.values():
            totals[label] += size
        return totals


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.base_model.model.model.language_model
