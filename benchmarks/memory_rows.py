"""Each part of the memory plan measured against its formula for benchmarks/memory_plan.py: kept for backward per
decoder layer, the LM head's peak, the generation prefill and cache, the vision tower's blocks and prefill, and a
whole prompt with an image; one row per size, the plan's figure beside the measured one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from fake_models import RANK, SavedBytes, build, few_layer_config, language_model
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from vision_grpo.plan import formulas as mf
from vision_grpo.plan.estimate import parameter_counts


def layer_rows(family: str, layer_types: list[str], batch: int, length: int) -> list[dict[str, Any]]:
    """Per decoder layer, kept for backward: plan vs measured (fake tensors), and the whole backbone's total."""
    config = few_layer_config(family, layer_types)
    shape = mf.shape_of(config)
    mode = FakeTensorMode()
    model = build(config, mode)
    lm = language_model(model)
    saved = SavedBytes(model, {f"layer {i}": layer for i, layer in enumerate(lm.layers)} | {"norm": lm.norm})
    tokens = batch * length
    with mode, saved.recording(), torch.autocast("cpu", dtype=torch.bfloat16):
        output = lm(input_ids=torch.zeros(batch, length, dtype=torch.long), use_cache=False)
    kept = saved.by_label
    del output
    rows = []
    for index, layer_type in enumerate(layer_types):
        planned = mf.text_layer_bytes_per_token(shape, layer_type, RANK, index == 0, "torch") * tokens
        rows.append({"layer": index, "type": layer_type, "plan": planned, "measured": kept[f"layer {index}"]})
    lora = parameter_counts(config, RANK, lora_on_vision=False, targets=None)["lora"]
    rows.append(
        {
            "total": True,
            "plan": sum(r["plan"] for r in rows) + lora * mf.BF16,
            "measured": sum(v for k, v in kept.items() if k != "norm"),
        }
    )
    return rows


def real_check(family: str, layer_type: str, length: int, narrow: bool) -> dict[str, int]:
    """The same one-layer count on fake and on real random tensors (real width, or 1/8 of it when `narrow`)."""
    config = few_layer_config(family, [layer_type], vocab=1024)
    if narrow:
        text = config.get_text_config()
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            setattr(text, key, max(1, getattr(text, key) // 8))
        if getattr(text, "linear_num_key_heads", None):
            text.linear_num_key_heads, text.linear_num_value_heads = 2, 4
    counts = {}
    for name, mode in (("fake", FakeTensorMode()), ("real", None)):
        model = build(config, mode)
        lm = language_model(model)
        saved = SavedBytes(model, {"layer": lm.layers[0], "norm": lm.norm})
        context = mode if mode is not None else contextlib.nullcontext()
        with context, saved.recording(), torch.autocast("cpu", dtype=torch.bfloat16):
            output = lm(input_ids=torch.zeros(1, length, dtype=torch.long), use_cache=False)
        counts[name] = saved.by_label["layer"]
        del output
    return counts


def head_rows(family: str, tokens: int) -> dict[str, float]:
    """TRL's fused LM head (the trainer's kernel, chunk and outputs) over `tokens` scored positions: kept for
    backward and the peak over its forward and backward, plan vs measured."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    shape = mf.shape_of(few_layer_config(family, ["full_attention"]))
    mode, saved = FakeTensorMode(), SavedBytes(torch.nn.Module(), {})
    with mode:
        weight = torch.empty(shape.vocab, shape.hidden, dtype=torch.bfloat16)
        saved.weights.add(weight.untyped_storage()._cdata)
        live = mf.LiveBytes(saved.weights)
        hidden = torch.empty(tokens, shape.hidden, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.zeros(tokens, dtype=torch.long)
        with live:
            baseline = live.start() - tokens * shape.hidden * mf.BF16  # the scored hidden states belong to the head
            with saved.recording(), torch.autocast("cpu", dtype=torch.bfloat16):
                log_probs, *_ = ChunkedLogProbFunction.apply(
                    hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy")
                )
            kept_measured = saved.by_label["other"]
            (-log_probs.sum()).backward()
    kept, transient = mf.head_bytes(shape, tokens, lm_head_trains=False)
    return {
        "kept_plan": kept,
        "kept_measured": kept_measured,
        "peak_plan": kept + transient,
        "peak_measured": live.peak - baseline,
    }


def generation_rows(family: str, layer_types: list[str], batch: int, prompt: int, steps: int) -> dict[str, float]:
    """The cache after a prefill of `prompt` tokens and `steps` decoding steps, and the prefill's peak above the
    weights, plan vs measured."""
    config = few_layer_config(family, layer_types)
    shape = mf.shape_of(config)
    mode = FakeTensorMode()
    model = build(config, mode)
    lm = language_model(model)
    live = mf.LiveBytes({t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]})
    # accelerate's bf16 wrapper of the model's forward stays on through TRL's unwrap for generation: autocast
    with mode, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ids = torch.zeros(batch, prompt, dtype=torch.long)
        with live:
            baseline = live.start()
            cache = lm(input_ids=ids, use_cache=True).past_key_values
            prefill_peak = live.peak - baseline
            for _ in range(steps):
                cache = lm(input_ids=ids[:, :1], past_key_values=cache, use_cache=True).past_key_values
    stored: dict[int, int] = {}
    for tensor in tree_leaves([vars(layer) for layer in cache.layers]):  # keys, values; DeltaNet's states
        if isinstance(tensor, torch.Tensor):
            stored[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()

    def planned_cache(length: int) -> float:
        return batch * (length * mf.kv_cache_bytes_per_token(shape) + mf.linear_state_bytes_per_sequence(shape))

    lora = parameter_counts(config, RANK, lora_on_vision=False, targets=None)["lora"]
    prefill_plan = (
        planned_cache(prompt)
        + batch * mf.prefill_bytes_per_sequence(shape, prompt, lora=True, deltanet="torch")
        + lora * mf.BF16
    )
    return {
        "cache_plan": planned_cache(prompt + steps),
        "cache_measured": sum(stored.values()),
        "prefill_peak_plan": prefill_plan,
        "prefill_peak_measured": prefill_peak,
    }


def vision_rows(family: str, side: int) -> dict[str, float]:
    """A vision tower with LoRA (lora_on_vision) on one `side` x `side` image: kept for backward by 2 blocks minus
    1 block, plan (per-patch terms and autocast's bf16 copy of the block's adapters) vs measured. On real tensors:
    the vision tower's window and sequence bookkeeping reads values, which fake tensors do not have."""
    kept, adapters = {}, 0
    for depth in (1, 2):
        config = few_layer_config(family, ["full_attention"], vision_depth=depth, vocab=1024)
        config.get_text_config().intermediate_size = 64  # the language model only takes the merged image tokens
        shape = mf.shape_of(config)
        patches, _ = mf.image_tokens(shape, side * side)
        grid = int(patches**0.5)
        model = build(config, None, lora_on_vision=True)
        visual = model.base_model.model.model.visual
        saved = SavedBytes(model, {"vision": visual})
        adapters = sum(p.numel() for n, p in visual.blocks[-1].named_parameters() if "lora_" in n)
        pixel_values = torch.randn(patches, 3 * shape.temporal_patch * shape.patch**2, dtype=torch.bfloat16)
        with saved.recording(), torch.autocast("cpu", dtype=torch.bfloat16):
            output = visual(pixel_values, grid_thw=torch.tensor([[1, grid, grid]]))
        kept[depth] = saved.by_label["vision"]
        del output
    block_plan = mf.vision_block_bytes_per_patch(shape, RANK) * patches + adapters * mf.BF16
    return {"patches": patches, "block_plan": block_plan, "slope_measured": kept[2] - kept[1], "one_block": kept[1]}


def vision_prefill_row(family: str, side: int) -> dict[str, float]:
    """The vision tower's peak per patch without gradient (generation encodes the images first), two blocks on one
    `side` x `side` image on real tensors, the float32 pixel patches alive as in TRL's generation inputs: plan vs
    measured."""
    config = few_layer_config(family, ["full_attention"], vision_depth=2, vocab=1024)
    config.get_text_config().intermediate_size = 64
    shape = mf.shape_of(config)
    patches, _ = mf.image_tokens(shape, side * side)
    grid = int(patches**0.5)
    model = build(config, None)
    visual = model.base_model.model.model.visual
    pixels = 3 * shape.temporal_patch * shape.patch**2
    live = mf.LiveBytes({t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]})
    pixel_values = torch.randn(patches, pixels)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), live:
        baseline = live.start() - pixel_values.untyped_storage().nbytes()
        output = visual(pixel_values.type(torch.bfloat16), grid_thw=torch.tensor([[1, grid, grid]]))
    del output
    planned = patches * (mf.vision_prefill_bytes_per_patch(shape) + mf.FP32 * pixels)
    return {"patches": patches, "plan": planned, "measured": live.peak - baseline}


def image_prefill_row(family: str, side: int) -> dict[str, float]:
    """The whole model's prefill of one prompt with one `side` x `side` image, as `generate` runs it (pixel patches in
    float32, the last position's logits only), on real tensors at 1/8 of the width (the vision tower reads its
    grid's values, which fake tensors do not have): plan (the vision tower's peak or the language model's with the
    encoded images alive, and the cache) vs measured."""
    layers = ["full_attention", "linear_attention"] if family == "Qwen3.5-4B" else ["full_attention"] * 2
    config = few_layer_config(family, layers)
    text, vision = config.get_text_config(), config.vision_config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        setattr(text, key, max(1, getattr(text, key) // 8))
    if getattr(text, "linear_num_key_heads", None):
        text.linear_num_key_heads, text.linear_num_value_heads = 2, 4
    vision.hidden_size, vision.intermediate_size, vision.num_heads = vision.hidden_size // 8, 512, 2
    vision.out_hidden_size = text.hidden_size
    vision.depth = 2
    if hasattr(vision, "deepstack_visual_indexes"):
        vision.deepstack_visual_indexes = [0, 1] if family == "Qwen3-VL-4B" else []
    shape = mf.shape_of(config)
    patches, image_tokens = mf.image_tokens(shape, side * side)
    grid = int(patches**0.5)
    model = build(config, None)
    pixels = 3 * shape.temporal_patch * shape.patch**2
    ids = [100] * 16 + [config.vision_start_token_id] + [config.image_token_id] * image_tokens
    ids = torch.tensor([[*ids, config.vision_end_token_id, *[100] * 16]])
    pixel_values = torch.randn(patches, pixels)
    live = mf.LiveBytes({t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), live:
        baseline = live.start() - pixel_values.untyped_storage().nbytes()
        output = model(
            input_ids=ids,
            pixel_values=pixel_values,
            image_grid_thw=torch.tensor([[1, grid, grid]]),
            mm_token_type_ids=(ids == config.image_token_id).long(),
            use_cache=True,
            logits_to_keep=1,
        )
    del output
    prompt = ids.shape[1]
    language = mf.prefill_bytes_per_sequence(shape, prompt, lora=True, deltanet="torch")
    language += image_tokens * mf.image_bytes_per_image_token(shape)
    encode = patches * (mf.vision_prefill_bytes_per_patch(shape) + mf.FP32 * pixels)
    lora = parameter_counts(config, RANK, lora_on_vision=False, targets=None)["lora"]
    cache = prompt * mf.kv_cache_bytes_per_token(shape) + mf.linear_state_bytes_per_sequence(shape)
    return {
        "patches": patches,
        "prompt": prompt,
        "plan": max(cache + language + lora * mf.BF16, encode),  # the adapters' bf16 copies come with the layers
        "peak_in": "vision tower" if encode > cache + language + lora * mf.BF16 else "language model",
        "measured": live.peak - baseline,
    }
