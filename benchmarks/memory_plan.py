"""The memory plan's formulas (vision_grpo/plan/formulas.py) against what the code keeps, per part, on CPU.

    python benchmarks/memory_plan.py [--quick] [--json FILE]

Each family's shipped config (vision_grpo/plan/model_configs/) at its real hidden size, heads, vocabulary and vision
width, with 1 or 2 decoder layers (and vision blocks), LoRA r=32 as the GeoQA recipes, bf16 autocast as training.
The models run on fake tensors (torch's FakeTensorMode): every op of transformers, PEFT and TRL runs with its real
shapes, dtypes and CPU autocast rules but no data, so real sizes (a 248k vocabulary, thousands of tokens) cost
seconds on a CPU whose bfloat16 matmuls are far too slow for them. Measured per part:
- kept for backward: each storage autograd saves (saved-tensor hooks), once, weights left out, attributed to a
  decoder layer, the vision tower or the LM head by module hooks; the slope between 1 and 2 layers is the
  per-layer cost the plan multiplies by the layer count;
- peaks: the bytes of live storages (a dispatch mode that sees every allocation and every free) over the LM head's
  forward and backward, over the language model's generation prefill (at two sizes), over the vision tower's
  forward without gradient, and over the whole model's prefill of a prompt with an image (real tensors at 1/8 of
  the width: the vision tower reads its grid's values), one image size per side of the plan's maximum;
- the generation cache: the bytes of the cache after a prefill and decoding steps.
One check runs the same decoder-layer count on real tensors at a small size: fake and real must agree exactly,
which is what makes the fake counts measurements. `--quick` runs smaller sizes, the vision tower of one family
and one narrow real-tensor check.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

# Its folder (for `common`) and the repository: also when run by runpy, which puts neither on the path
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import markdown_table, report  # noqa: E402

from vision_grpo.models.vision import VISION_MODULE_PATTERN  # noqa: E402
from vision_grpo.plan import formulas as mf  # noqa: E402
from vision_grpo.plan.build import SHIPPED_CONFIGS, parameter_counts  # noqa: E402

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
        planned = mf.text_layer_bytes_per_token(shape, layer_type, RANK, index == 0) * tokens
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
        planned_cache(prompt) + batch * mf.prefill_bytes_per_sequence(shape, prompt, lora=True) + lora * mf.BF16
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
    language = mf.prefill_bytes_per_sequence(shape, prompt, lora=True)
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


def ratio(measured: float, planned: float) -> str:
    return f"{measured / planned:.2f}" if planned else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and a narrow real-tensor check")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    # Full: a GeoQA micro-batch, 8 x (about 300 prompt + 1,024 completion) tokens, and TRL's 64 sequences generated
    batch, length, steps = (1, 256, 4) if args.quick else (8, 1324, 16)
    # Generation: TRL's 64 sequences from a 300-token prompt, and from a GeoQA prompt with a capped image (Qwen3)
    gen_sizes = [(2, 128), (4, 512)] if args.quick else [(64, 300), (64, 1217)]
    side = 112 if args.quick else 224  # real tensors: bfloat16 matmuls on CPU limit the image
    figures: dict[str, Any] = {"quick": args.quick, "families": {}}
    rows: list[list[Any]] = []
    for family in FAMILIES:
        types = ["linear_attention"] if family == "Qwen3.5-4B" else ["full_attention"]
        found: dict[str, Any] = {}
        print(f"({family}: {time.perf_counter() - start:.0f} s, layer_rows)", file=sys.stderr, flush=True)
        one, two = layer_rows(family, types, batch, length), layer_rows(family, types * 2, batch, length)
        found["layers"] = {"1": one, "2": two}
        slope = two[-1]["measured"] - one[-1]["measured"]
        for row in two[:-1]:
            rows.append(
                [
                    family,
                    f"decoder layer {row['layer']} ({row['type']}), kept",
                    row["plan"] / MiB,
                    row["measured"] / MiB,
                    ratio(row["measured"], row["plan"]),
                ]
            )
        if family == "Qwen3.5-4B":
            mixed = layer_rows(family, ["linear_attention", "full_attention"], batch, length)
            found["layers"]["linear+full"] = mixed
            rows.append(
                [
                    family,
                    "decoder layer 1 (full_attention), kept",
                    mixed[1]["plan"] / MiB,
                    mixed[1]["measured"] / MiB,
                    ratio(mixed[1]["measured"], mixed[1]["plan"]),
                ]
            )
        planned_slope = two[-1]["plan"] - one[-1]["plan"]
        rows.append(
            [
                family,
                "2 layers minus 1 layer (whole backbone)",
                planned_slope / MiB,
                slope / MiB,
                ratio(slope, planned_slope),
            ]
        )
        print(f"({family}: {time.perf_counter() - start:.0f} s, head_rows)", file=sys.stderr, flush=True)
        head = head_rows(family, batch * (length - 1))
        found["head"] = head
        rows.append(
            [
                family,
                "LM head, kept",
                head["kept_plan"] / MiB,
                head["kept_measured"] / MiB,
                ratio(head["kept_measured"], head["kept_plan"]),
            ]
        )
        rows.append(
            [
                family,
                "LM head, peak (CPU torch fallback; plan: CUDA)",
                head["peak_plan"] / MiB,
                head["peak_measured"] / MiB,
                ratio(head["peak_measured"], head["peak_plan"]),
            ]
        )
        print(f"({family}: {time.perf_counter() - start:.0f} s, generation_rows)", file=sys.stderr, flush=True)
        # Qwen3.5's Gated DeltaNet layer sets its prefill peak: put it last, as in a deep model (the layer input is
        # then not the embeddings, and autocast's bf16 copies of every layer's adapters are alive)
        gen_layers = types * 2 if family != "Qwen3.5-4B" else ["full_attention", "linear_attention"]
        found["generation"] = {}
        for gen_batch, prompt in gen_sizes:
            gen = generation_rows(family, gen_layers, gen_batch, prompt, steps)
            found["generation"][f"{gen_batch}x{prompt}"] = gen
            if prompt == gen_sizes[0][1]:
                rows.append(
                    [
                        family,
                        "generation cache (2 layers)",
                        gen["cache_plan"] / MiB,
                        gen["cache_measured"] / MiB,
                        ratio(gen["cache_measured"], gen["cache_plan"]),
                    ]
                )
            rows.append(
                [
                    family,
                    f"generation prefill peak (2 layers, {gen_batch} x {prompt} tokens)",
                    gen["prefill_peak_plan"] / MiB,
                    gen["prefill_peak_measured"] / MiB,
                    ratio(gen["prefill_peak_measured"], gen["prefill_peak_plan"]),
                ]
            )
        print(f"({family}: {time.perf_counter() - start:.0f} s, image_prefill_row)", file=sys.stderr, flush=True)
        found["image_prefill"] = {}
        for image_side in (224, 448):  # the language model's peak with the image alive; the vision tower's
            whole = image_prefill_row(family, image_side)
            found["image_prefill"][str(image_side)] = whole
            rows.append(
                [
                    family,
                    f"whole-model prefill, {whole['prompt']} tokens with a {image_side}px image (1/8 width, real "
                    f"tensors), peak in the {whole['peak_in']}",
                    whole["plan"] / MiB,
                    whole["measured"] / MiB,
                    ratio(whole["measured"], whole["plan"]),
                ]
            )
        print(f"({family}: {time.perf_counter() - start:.0f} s, vision_rows)", file=sys.stderr, flush=True)
        if args.quick and family != "Qwen2.5-VL-3B":
            figures["families"][family] = found
            continue
        vision = vision_rows(family, side)
        found["vision"] = vision
        rows.append(
            [
                family,
                f"vision block with LoRA ({vision['patches']} patches), 2 minus 1 block",
                vision["block_plan"] / MiB,
                vision["slope_measured"] / MiB,
                ratio(vision["slope_measured"], vision["block_plan"]),
            ]
        )
        encode = vision_prefill_row(family, side)
        found["vision_prefill"] = encode
        rows.append(
            [
                family,
                f"vision tower without gradient ({encode['patches']} patches), peak",
                encode["plan"] / MiB,
                encode["measured"] / MiB,
                ratio(encode["measured"], encode["plan"]),
            ]
        )
        figures["families"][family] = found
        print(f"({family}: {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    check_length = 64
    figures["real_check"] = {
        family: real_check(family, t, check_length, narrow=args.quick)
        for family, t in (("Qwen2.5-VL-3B", "full_attention"), ("Qwen3.5-4B", "linear_attention"))
        if family == "Qwen3.5-4B" or not args.quick
    }
    print(
        f"sizes: micro-batch {batch} x {length} tokens, {side}x{side} image (vision, real tensors), "
        f"generation {gen_sizes} (sequences, prompt), LoRA r={RANK}, bf16 autocast, fake tensors"
    )
    print(markdown_table(["family", "part", "plan MiB", "measured MiB", "measured / plan"], rows))
    width = "1/8 width" if args.quick else "real width"
    for family, counts in figures["real_check"].items():
        print(
            f"fake vs real tensors, {family} one layer ({width}, {check_length} tokens): "
            f"{counts['fake']:,} vs {counts['real']:,} bytes kept"
        )
    figures["rows"] = rows
    figures["seconds"] = time.perf_counter() - start
    report("memory_plan", figures, args.json)


if __name__ == "__main__":
    main()
