"""The memory a GRPO step needs, part by part, as functions of the model's config and the recipe's sizes.

Every figure is in bytes per GPU rank. The terms follow what the code that runs keeps alive: transformers' Qwen-VL
layers under bf16 autocast with PEFT LoRA adapters (PEFT keeps adapters in float32 and casts each adapter's input, so
every adapted projection keeps its own bf16 copy of its input for backward), TRL 1.16's fused LM head
(`trl.kernels.chunked_logprob.ChunkedLogProbFunction`: no `(batch, length, vocabulary)` logits, a 4096 x 32768 tile
instead, and the hidden states it scores kept for backward) and transformers' `generate` with its dynamic cache.
benchmarks/memory_plan.py measures each term on real-width few-layer models; docs/memory.md has the comparison.
Qwen3.5's Gated DeltaNet terms take the path its layers run (`GatedDeltaNetPath`: the kernels or the torch fallback).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from vision_grpo.models.gated_deltanet import GatedDeltaNetPath
from vision_grpo.plan.fake_count import LiveBytes, materialise_fake

BF16, FP32 = 2, 4
# trl.kernels.chunked_logprob: tokens per tile (TOKEN_CHUNK_SIZE) x vocabulary columns per tile (the trainer's chunk)
HEAD_TILE_TOKENS, HEAD_TILE_VOCAB = 4096, 32768
# fla.ops.gated_delta_rule.chunk_gated_delta_rule's default chunk_size, the one transformers runs
FLA_CHUNK = 64


@dataclass(frozen=True)
class ModelShape:
    """The widths of a Qwen-VL checkpoint that memory depends on, read from its config."""

    model_type: str
    hidden: int
    intermediate: int
    layer_types: tuple[str, ...]  # "full_attention" or "linear_attention" (Qwen3.5's Gated DeltaNet), per layer
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool  # Qwen3-VL and Qwen3.5 normalise queries and keys (float32 copies kept)
    attn_output_gate: bool  # Qwen3.5's full-attention layers gate their output (q_proj is twice as wide)
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    linear_conv_kernel: int
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    patch: int
    merge: int
    temporal_patch: int
    vision_gated_mlp: bool  # Qwen2.5-VL: gate/up/down with SiLU; Qwen3-VL and Qwen3.5: fc1/fc2 with GELU
    vision_pos_embed: bool  # Qwen3-VL and Qwen3.5 add interpolated learned position embeddings (float32, kept)
    deepstack_levels: int  # Qwen3-VL: vision features of this many blocks added to the first decoder layers
    rotary_dim: int  # the text rotary embedding's width (Qwen3.5 rotates a quarter of each head)


def shape_of(config) -> ModelShape:
    """The `ModelShape` of a transformers config of the Qwen-VL families (Qwen2.5-VL, Qwen3-VL, Qwen3.5)."""
    text, vision = config.get_text_config(), config.vision_config
    layers = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return ModelShape(
        model_type=config.model_type,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        layer_types=tuple(layers),
        heads=text.num_attention_heads,
        kv_heads=text.num_key_value_heads,
        head_dim=head_dim,
        vocab=text.vocab_size,
        qk_norm=config.model_type != "qwen2_5_vl",
        attn_output_gate=bool(getattr(text, "attn_output_gate", False)),
        linear_key_heads=getattr(text, "linear_num_key_heads", 0) or 0,
        linear_value_heads=getattr(text, "linear_num_value_heads", 0) or 0,
        linear_key_dim=getattr(text, "linear_key_head_dim", 0) or 0,
        linear_value_dim=getattr(text, "linear_value_head_dim", 0) or 0,
        linear_conv_kernel=getattr(text, "linear_conv_kernel_dim", 0) or 0,
        vision_depth=vision.depth,
        vision_hidden=vision.hidden_size,
        vision_intermediate=vision.intermediate_size,
        vision_heads=vision.num_heads,
        patch=vision.patch_size,
        merge=vision.spatial_merge_size,
        temporal_patch=vision.temporal_patch_size,
        vision_gated_mlp=config.model_type == "qwen2_5_vl",
        vision_pos_embed=bool(getattr(vision, "num_position_embeddings", 0)),
        deepstack_levels=len(getattr(vision, "deepstack_visual_indexes", None) or []),
        rotary_dim=int(head_dim * ((getattr(text, "rope_parameters", None) or {}).get("partial_rotary_factor") or 1.0)),
    )


def image_tokens(shape: ModelShape, pixels: int) -> tuple[int, int]:
    """(vision patches, language-model image tokens) of one image of about `pixels` pixels: the processor rounds each
    side to a multiple of patch x merge; one patch per `patch`^2 pixels (x temporal patch frames of a still image,
    folded into one patch), one image token per merge^2 patches."""
    unit = shape.patch * shape.merge
    side = max(unit, round(pixels**0.5 / unit) * unit)
    patches = (side // shape.patch) ** 2
    return patches, patches // shape.merge**2


def text_layer_bytes_per_token(
    shape: ModelShape, layer_type: str, lora_rank: int, first: bool, deltanet: GatedDeltaNetPath
) -> float:
    """Bytes one decoder layer keeps for backward per token (no gradient checkpointing), its Gated DeltaNet mixer
    (Qwen3.5's linear_attention layers) on the `deltanet` path.

    `lora_rank` 0 means full fine-tuning (each linear keeps its input once); with LoRA every adapted projection keeps
    its own bf16 copy of its input plus the rank-wide middle. The first layer's input norm keeps nothing (its input,
    the frozen embedding, needs no gradient).
    """
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = (0 if first else FP32 * h) + FP32 * h  # RMSNorm keeps its float32 input: input and post-attention norms

    def inputs(*widths: int, shared: int) -> float:  # LoRA: one copy per projection; full fine-tuning: one per input
        return BF16 * sum(widths) + 2 * BF16 * lora_rank * len(widths) if lora_rank else BF16 * shared

    mlp = 3 * BF16 * i + inputs(h, h, shared=h) + inputs(i, shared=i)  # gate, act(gate), up; down's input
    if layer_type == "linear_attention":
        mixer_in = shape.linear_value_heads * shape.linear_value_dim
        kept = (
            gated_delta_net_bytes_per_token(shape)
            if deltanet == "torch"
            else gated_delta_net_kernel_bytes_per_token(shape)
        )
        mixer = kept + inputs(h, h, h, h, mixer_in, shared=h + mixer_in)
        return norms + mixer + mlp
    attention = 2 * BF16 * q + 2 * BF16 * kv + FP32 * shape.heads  # sdpa: q, out, k, v, log-sum-exp
    if shape.qk_norm:
        attention += FP32 * (q + kv)
    if shape.attn_output_gate:
        attention += 2 * BF16 * q  # sigmoid(gate) and the attention output it multiplies
    return norms + attention + inputs(h, h, h, q, shared=h + q) + mlp


def _fake_gated_delta_net(shape: ModelShape) -> torch.nn.Module:
    """transformers' Qwen3.5 Gated DeltaNet mixer at `shape`'s widths, built on the meta device (no weights)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = AutoConfig.for_model(
        "qwen3_5_text",
        hidden_size=shape.hidden,
        linear_num_key_heads=shape.linear_key_heads,
        linear_num_value_heads=shape.linear_value_heads,
        linear_key_head_dim=shape.linear_key_dim,
        linear_value_head_dim=shape.linear_value_dim,
        linear_conv_kernel_dim=shape.linear_conv_kernel,
    )
    with torch.device("meta"):
        return Qwen3_5GatedDeltaNet(config, 0)


@functools.cache
def gated_delta_net_bytes_per_token(shape: ModelShape, tokens: int = 256) -> float:
    """Bytes per token that Qwen3.5's Gated DeltaNet mixer (without its projections' inputs) keeps for backward,
    counted by running transformers' own module on fake tensors (shapes and dtypes only, no data) under bf16
    autocast, as training runs it: the torch fallback that runs without the flash-linear-attention kernels keeps
    many per-chunk tensors, too many terms to restate here. Autocast matters: its matmuls then keep bf16 copies of
    their float32 operands, and the meta device (which autocast does not reach) would count float32 ones instead.
    The frozen weights are left out (they are the weights part of the plan)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mixer = _fake_gated_delta_net(shape)
    with FakeTensorMode():
        materialise_fake(mixer, dtype=torch.bfloat16, trainable=False)
        weights = {p.untyped_storage()._cdata for p in mixer.parameters()}
        hidden = torch.empty(1, tokens, shape.hidden, dtype=torch.bfloat16, device="cpu", requires_grad=True)
        saved: dict[int, tuple[StorageWeakRef, int]] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage._cdata not in weights:  # a storage freed during the forward may be reused: keep the last
                saved[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
            return tensor

        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            output = mixer(hidden)  # holds the graph, so what backward needs is alive below
        total = sum(size for ref, size in saved.values() if not ref.expired())
        del output
    return total / tokens


@functools.cache
def gated_delta_net_prefill_bytes(shape: ModelShape, prompt: int) -> float:
    """Peak bytes above its input of Qwen3.5's Gated DeltaNet mixer over one sequence's `prompt`-token prefill (no
    gradient, bf16 autocast as generation runs under accelerate), counted by running transformers' module on fake
    tensors: its torch fallback pads the prompt to whole 64-token chunks and holds several float32 per-head copies
    of queries, keys and values at once, so the count is taken at the real prompt length."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mixer = _fake_gated_delta_net(shape)
    with FakeTensorMode(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        materialise_fake(mixer, dtype=torch.bfloat16, trainable=False)
        hidden = torch.empty(1, prompt, shape.hidden, dtype=torch.bfloat16, device="cpu")
        live = LiveBytes({p.untyped_storage()._cdata for p in mixer.parameters()} | {hidden.untyped_storage()._cdata})
        with live:
            live.start()
            output = mixer(hidden)
        del output
    return float(live.peak)


def gated_delta_net_kernel_bytes_per_token(shape: ModelShape) -> float:
    """Bytes per token that Qwen3.5's Gated DeltaNet mixer (without its projections' inputs) keeps for backward on
    the kernel path: what causal-conv1d's `CausalConv1dFn` (causal_conv1d/causal_conv1d_interface.py) and
    flash-linear-attention 0.5's `ChunkGatedDeltaRuleFunction` (fla/ops/gated_delta_rule/chunk.py) save, and what
    transformers' torch code around them saves on both paths:

    - the convolution's input, the q/k/v projection's bf16 output (SiLU is fused, recomputed in backward);
    - the gates: sigmoid's bf16 output beta (the tensor fla saves as beta) and softplus's float32 input;
    - fla: q and k after its fused l2 norm (bf16) with a float32 reciprocal norm per head, the contiguous copy of v
      its `input_guard` makes (bf16), the chunk-local cumulative gate (float32 per value head) and A, each 64-token
      chunk's solved (I + A)^-1 as 64 bf16 per token and value head, the one term the chunk sets. The per-chunk
      states h and the WY terms w, u are recomputed in backward, not kept;
    - the gated RMSNorm: float32 copies of the output, of the gate z and of SiLU(z), a reciprocal norm per head, and
      the bf16 weighted output.

    The torch fallback keeps float32 per-chunk copies of q, k, v and 64 x 64 float32 matrices per chunk and head
    instead (`gated_delta_net_bytes_per_token`). fla needs CUDA, so this count is not measured here:
    tests/test_plan_kernels.py runs transformers' module with stand-ins that allocate and save what the kernels'
    code does."""
    k_heads, v_heads = shape.linear_key_heads, shape.linear_value_heads
    key, value = k_heads * shape.linear_key_dim, v_heads * shape.linear_value_dim
    gates = BF16 * v_heads + FP32 * v_heads
    fla = 2 * BF16 * key + 2 * FP32 * k_heads + BF16 * value + FP32 * v_heads + BF16 * FLA_CHUNK * v_heads
    norm = 3 * FP32 * value + FP32 * v_heads + BF16 * value
    return BF16 * (2 * key + value) + gates + fla + norm


def gated_delta_net_kernel_prefill_bytes(shape: ModelShape, prompt: int) -> float:
    """Peak bytes above its input of Qwen3.5's Gated DeltaNet mixer over one sequence's `prompt`-token prefill on the
    kernel path (no gradient), when fla's `chunk_fwd_o` allocates the output. Alive then, per token: the bf16
    convolution output (its q, k, v views live through the forward), z, b, a, beta and the float32 gate; in fla the
    contiguous copies of q, k, v (`input_guard`), the l2-normed q, k and their float32 norms, the float32 cumulative
    gate, A (64 bf16 per value head), w (key dim per value head), u, v_new and o (value-wide bf16 each); and per
    started 64-token chunk its bf16 state h (value heads x key dim x value dim). The float32 final state is the
    cache's; the gated RMSNorm after it holds less."""
    k_heads, v_heads = shape.linear_key_heads, shape.linear_value_heads
    key, value = k_heads * shape.linear_key_dim, v_heads * shape.linear_value_dim
    module = BF16 * (2 * key + value) + BF16 * value + 3 * BF16 * v_heads + FP32 * v_heads
    inside = BF16 * (2 * key + value) + 2 * BF16 * key + 2 * FP32 * k_heads + FP32 * v_heads
    inside += BF16 * FLA_CHUNK * v_heads + BF16 * v_heads * shape.linear_key_dim + 3 * BF16 * value
    states = -(-prompt // FLA_CHUNK) * BF16 * v_heads * shape.linear_key_dim * shape.linear_value_dim
    return (module + inside) * prompt + states


def prefill_bytes_per_sequence(shape: ModelShape, prompt: int, lora: bool, deltanet: GatedDeltaNetPath) -> float:
    """Peak bytes of the language model's prefill of one `prompt`-token sequence above its cache (no gradient).

    Alive at the peak, besides the cache being built: the input embeddings (the model's forward holds them), the
    decoder layer's input, and the largest layer's transient. In a full-attention layer that is its MLP's up
    projection: act(gate), up's base output and (with LoRA) the adapter's output and its scaled copy, each
    intermediate-wide bf16, with the adapter's float32 copy of its input, the post-attention residual and its norm;
    sdpa holds no prompt x prompt matrix. In a Gated DeltaNet layer, the mixer over the normed input, on the
    `deltanet` path: the kernels, or the chunked torch fallback (counted). The rotary cosine and sine tables stay
    alive through all layers."""
    h, i = shape.hidden, shape.intermediate
    stream = 2 * BF16 * h + 2 * BF16 * shape.rotary_dim  # embeddings, layer input; rotary cos and sin
    peaks = []
    if "full_attention" in shape.layer_types:
        mlp = (4 * BF16 * i + FP32 * h) if lora else 3 * BF16 * i
        peaks.append((mlp + 2 * BF16 * h) * prompt)
    if "linear_attention" in shape.layer_types:
        mixer = (
            gated_delta_net_prefill_bytes(shape, prompt)
            if deltanet == "torch"
            else gated_delta_net_kernel_prefill_bytes(shape, prompt)
        )
        peaks.append(BF16 * h * prompt + mixer)
    return stream * prompt + max(peaks)


def vision_prefill_bytes_per_patch(shape: ModelShape) -> float:
    """Peak bytes per patch of the vision tower's forward without gradient (generation encodes every image of the
    generation batch in one call). The peak is the rotary embedding of a block's attention: the bf16 qkv output
    and six float32 copies of queries and keys (`apply_rotary_pos_emb_vision` upcasts q and k, rotates and adds),
    the block's input and its norm, the bf16 copy of the pixel patches, the float32 cosine and sine, and in the
    Qwen3 families the float32 interpolated position embeddings the forward keeps."""
    d = shape.vision_hidden
    pixels = 3 * shape.temporal_patch * shape.patch**2
    head = d // shape.vision_heads
    peak = 3 * BF16 * d + 6 * FP32 * d + 2 * BF16 * d + BF16 * pixels + 2 * FP32 * head
    return peak + (FP32 * d if shape.vision_pos_embed else 0)


def image_bytes_per_image_token(shape: ModelShape) -> float:
    """Bytes per image token that stay alive through the language model's prefill once the images are encoded: the
    float32 pixel patches (TRL's generation inputs), the vision tower's last hidden states (merge^2 patches per
    token), its merged output and the concatenated copy the model scatters into the embeddings, and in Qwen3-VL
    each deepstack level's features and their concatenated copy."""
    pixels = 3 * shape.temporal_patch * shape.patch**2
    encoded = 2 * BF16 * shape.hidden * (1 + shape.deepstack_levels)
    return shape.merge**2 * (FP32 * pixels + BF16 * shape.vision_hidden) + encoded


def cached_bytes_per_image_token(shape: ModelShape) -> float:
    """Bytes per image token a frozen tower's step cache holds for a distinct image: the bf16 pixel patches it
    confirms matches with, the tower's last hidden states, its merged output and each deepstack level's features."""
    pixels = 3 * shape.temporal_patch * shape.patch**2
    return shape.merge**2 * BF16 * (pixels + shape.vision_hidden) + BF16 * shape.hidden * (1 + shape.deepstack_levels)


def vision_block_bytes_per_patch(shape: ModelShape, lora_rank: int) -> float:
    """Bytes one vision block keeps for backward per patch when it trains (LoRA on the vision tower, or full)."""
    d, i = shape.vision_hidden, shape.vision_intermediate

    def inputs(*widths: int, shared: int) -> float:
        return BF16 * sum(widths) + 2 * BF16 * lora_rank * len(widths) if lora_rank else BF16 * shared

    norms = 2 * FP32 * d  # RMSNorm (Qwen2.5-VL) or LayerNorm (autocast runs it in float32): its float32 input
    attention = 4 * BF16 * d + FP32 * shape.vision_heads + inputs(d, d, shared=2 * d)  # q, k, v, out; qkv, proj
    if shape.vision_gated_mlp:
        mlp = 3 * BF16 * i + inputs(d, d, i, shared=d + i)
    else:
        mlp = BF16 * i + inputs(d, i, shared=d + i)  # fc1's output (GELU's input); fc1's and fc2's inputs
    return norms + attention + mlp


def kv_cache_bytes_per_token(shape: ModelShape) -> int:
    """The dynamic cache's keys and values per token (bf16), over the full-attention layers."""
    full = sum(t == "full_attention" for t in shape.layer_types)
    return full * 2 * shape.kv_heads * shape.head_dim * BF16


def linear_state_bytes_per_sequence(shape: ModelShape) -> int:
    """Qwen3.5's per-sequence Gated DeltaNet state: the float32 recurrent state and the bf16 convolution window."""
    linear = sum(t == "linear_attention" for t in shape.layer_types)
    recurrent = shape.linear_value_heads * shape.linear_key_dim * shape.linear_value_dim * FP32
    conv_dim = 2 * shape.linear_key_heads * shape.linear_key_dim + shape.linear_value_heads * shape.linear_value_dim
    return linear * (recurrent + conv_dim * shape.linear_conv_kernel * BF16)


def head_bytes(shape: ModelShape, scored_tokens: int, lm_head_trains: bool) -> tuple[float, float]:
    """(kept for backward, transient peak) of TRL 1.16's fused LM head over `scored_tokens` positions.

    Kept: the scored hidden states (bf16), their targets and two float32 statistics. Transient: one bf16 tile of
    at most 4096 x 32768 logits, reused for every chunk, and in backward the float32 gradient of the hidden states
    (and of the head's weight when it trains)."""
    kept = scored_tokens * (BF16 * shape.hidden + 8 + 2 * FP32)
    tile = min(scored_tokens, HEAD_TILE_TOKENS) * min(HEAD_TILE_VOCAB, shape.vocab) * BF16
    backward = scored_tokens * shape.hidden * FP32 + (shape.vocab * shape.hidden * FP32 if lm_head_trains else 0)
    return kept, tile + backward


def expected_extra_groups(dead_share: float, rounds: int) -> float:
    """Dynamic sampling's expected extra groups per step, as a share of the generation batch's: round k generates the
    M_k groups still missing and finds each with signal at 1 - d, so E[M_k+1] = d E[M_k] from E[M_0] = d, summed over
    k = 0 .. `rounds` - 1 (one process; on several, each round generates the most any rank misses: a little more)."""
    return dead_share * (1 - dead_share**rounds) / (1 - dead_share)
