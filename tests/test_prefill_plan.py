"""The memory plan's generation prefill term against the peak of live tensors over a real prefill: each family's
shipped config at its real width with two decoder layers, run on fake tensors (real shapes, dtypes and autocast, no
data: this CPU's bf16 matmuls are too slow for real ones), the model built as the trainer builds it (LoRA on every
linear of the language model, or without adapters as full fine-tuning), no gradient and bf16 autocast as generation
runs."""

from __future__ import annotations

import pytest
import torch

from vision_grpo.plan import estimate as plan_build
from vision_grpo.plan import formulas as mf

FAMILIES = {
    "qwen2_5_vl": ("Qwen--Qwen2.5-VL-3B-Instruct", ["full_attention"] * 2),
    "qwen3_vl": ("Qwen--Qwen3-VL-4B-Instruct", ["full_attention"] * 2),
    # The Gated DeltaNet layer sets Qwen3.5's peak: last, as in a deep model (its input is not the embeddings)
    "qwen3_5": ("Qwen--Qwen3.5-4B", ["full_attention", "linear_attention"]),
}
RANK = 8


@pytest.mark.parametrize(("batch", "prompt", "lora"), [(1, 96, True), (3, 200, True), (3, 200, False)])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_term_matches_the_peak_of_a_real_width_prefill(
    family: str, batch: int, prompt: int, lora: bool
) -> None:
    """Within 20% at two sizes (the growth in batch and prompt length, and Qwen3.5's 64-token chunk padding); the
    old term, 3 x intermediate bf16 per prompt token, was 1.7x (Qwen2.5-VL) to 3.7x (Qwen3.5) low."""
    from peft import LoraConfig, get_peft_model
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig, AutoModelForImageTextToText

    name, layer_types = FAMILIES[family]
    config = AutoConfig.from_pretrained(plan_build.SHIPPED_CONFIGS / f"{name}.json")
    text = config.get_text_config()
    text.num_hidden_layers, text.vocab_size = len(layer_types), 512
    if getattr(text, "layer_types", None):
        text.layer_types = layer_types
    config.vision_config.depth = 1
    if getattr(config.vision_config, "deepstack_visual_indexes", None):
        config.vision_config.deepstack_visual_indexes = []
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if lora:
        model = get_peft_model(model, LoraConfig(r=RANK, target_modules="all-linear", exclude_modules=r".*visual.*"))
    mode = FakeTensorMode()
    with mode:
        mf.materialise_fake(model)
    language_model = (model.base_model.model if lora else model).model.language_model
    live = mf.LiveBytes({t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]})
    with mode, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ids = torch.zeros(batch, prompt, dtype=torch.long)
        with live:
            baseline = live.start()
            cache = language_model(input_ids=ids, use_cache=True).cache
    measured = live.peak - baseline
    del cache

    shape = mf.shape_of(config)
    adapters = plan_build.parameter_counts(config, RANK if lora else 0, lora_on_vision=False, targets=None)["lora"]
    cache_bytes = batch * (prompt * mf.kv_cache_bytes_per_token(shape) + mf.linear_state_bytes_per_sequence(shape))
    planned = (
        cache_bytes
        + batch * mf.prefill_bytes_per_sequence(shape, prompt, lora=lora, deltanet="torch")
        + adapters * mf.BF16
    )
    assert 0.8 < measured / planned < 1.2, (measured, planned)
