"""What each replica keeps of its Qwen-VL family: the model and processor classes, the chat template TRL ships, the
toy-size configs with the features that set the family apart, Qwen's special and added tokens, the image-processor
settings, the published generation defaults, and the tokenizer's splitting rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX as QWEN3_5_PRETOKENIZE_REGEX
from trl.chat_template_utils import (
    qwen2_5_vl_chat_template,
    qwen3_5_think_chat_template,
    qwen3_vl_chat_template,
)

# Qwen's special tokens, in Qwen's order (their ids keep Qwen's relative layout): the control and vision tokens.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Tokens every Qwen tokenizer adds after those, as *non-special* added tokens (decoding keeps them), as on the Hub.
QWEN2_5_ADDED = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
QWEN3_ADDED = [*QWEN2_5_ADDED, "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen2.5-VL-3B-Instruct's generation_config.json: near-greedy sampling with a repetition penalty, which anything
# that wants plain greedy decoding must override (the evaluator builds its own GenerationConfig for that reason).
QWEN2_5_VL_GENERATION = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.1, "top_k": 1, "top_p": 0.001}
# Qwen3-VL-2B-Instruct's generation_config.json.
QWEN3_VL_GENERATION = {"do_sample": True, "repetition_penalty": 1.0, "temperature": 0.7, "top_k": 20, "top_p": 0.8}

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def byte_level_rules(tokenizer: Tokenizer) -> None:
    """Byte-level BPE splitting digits one per token: what the Qwen2.5-VL and Qwen3-VL replicas are trained with."""
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def qwen3_5_rules(tokenizer: Tokenizer) -> None:
    """Qwen3.5's normaliser and pre-tokenizer as `Qwen3_5Tokenizer` builds them (NFC, its own split regex, byte
    level), so the merges are learnt on the pieces that class will cut when it loads the replica."""
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass(frozen=True)
class Family:
    """What makes a replica faithful to one Qwen-VL family: classes, template, vision settings, tokens, defaults."""

    model_cls: type[PreTrainedModel]
    processor_cls: type[ProcessorMixin]
    chat_template: str
    config: Callable[[PreTrainedTokenizerFast], PretrainedConfig]
    patch_size: int  # vision patch side; one image token covers (patch_size * 2)^2 pixels after the 2x2 merge
    image_mean: list[float]
    image_std: list[float]
    added_tokens: list[str]
    generation: dict[str, Any] | None = None  # the Hub's generation_config.json; None: the family ships none
    tokenizer_rules: Callable[[Tokenizer], None] = byte_level_rules
    hub_tokenizer_class: str | None = None  # the class name the Hub's tokenizer_config.json gives, where it matters
    vocab_multiple: int = 1  # the model's vocabulary rows: the tokenizer's rounded up to this (Qwen pads to 128)
    flat_config: bool = False  # config.json in the pre-transformers-5 flat form, as the Hub repository has it

    @property
    def cell(self) -> int:
        """Side in pixels of the image area one image token stands for (patch merged 2x2)."""
        return self.patch_size * 2


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The config fields that name Qwen's control and vision tokens, as ids of `tokenizer`."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def _text_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The text config's vocabulary size (the tokenizer's: padding comes after the weights are drawn, see
    `build_replica`) and control-token ids."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }


def qwen2_5_vl_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL at toy size: text 128 x 2 layers (GQA 4/2), window-attention vision tower 64 x 2 blocks (one
    full-attention block), mrope sections over a 32-dim head."""
    return Qwen2_5_VLConfig(
        text_config={
            **_text_ids(tokenizer),
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 128,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        },
        **_token_ids(tokenizer),
        tie_word_embeddings=True,
    )


# The toy sizes the two Qwen3 families share: a 64-wide, 4-layer text model (GQA 4/2: room for Qwen3.5's 3:1 layer
# pattern and for Qwen3-VL's three deepstack features, which enter the first three layers) and a 32-wide, 3-block
# vision tower with 16-pixel patches merged 2x2 and learned position embeddings on the real 48x48 grid (2304), which
# the model interpolates to each image's patch grid.
QWEN3_TOY_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
QWEN3_TOY_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
}


def qwen3_vl_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3VLConfig:
    """Qwen3-VL at toy size: interleaved mrope over a 16-dim head, and three deepstack mergers (as the real model's)
    feeding the features of vision blocks 0, 1 and 2 into the first three language-model layers."""
    return Qwen3VLConfig(
        text_config={
            **_text_ids(tokenizer),
            **QWEN3_TOY_TEXT,
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
        vision_config={**QWEN3_TOY_VISION, "deepstack_visual_indexes": [0, 1, 2]},
        **_token_ids(tokenizer),
        tie_word_embeddings=True,
    )


def qwen3_5_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3_5Config:
    """Qwen3.5 at toy size: the real 3:1 pattern (`full_attention_interval` 4: three Gated-DeltaNet linear-attention
    layers, then one gated full-attention layer), partial rotary (1/4 of the head) with interleaved mrope."""
    return Qwen3_5Config(
        text_config={
            **_text_ids(tokenizer),
            **QWEN3_TOY_TEXT,
            "full_attention_interval": 4,
            "head_dim": 32,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        },
        vision_config={**QWEN3_TOY_VISION},
        **_token_ids(tokenizer),
        tie_word_embeddings=True,
    )


FAMILIES: dict[str, Family] = {
    "qwen2.5-vl": Family(
        model_cls=Qwen2_5_VLForConditionalGeneration,
        processor_cls=Qwen2_5_VLProcessor,
        chat_template=qwen2_5_vl_chat_template,
        config=qwen2_5_vl_config,
        patch_size=14,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        added_tokens=QWEN2_5_ADDED,
        generation=QWEN2_5_VL_GENERATION,
        vocab_multiple=128,  # the Hub's 151,936 rows for a 151,665-token tokenizer
        flat_config=True,
    ),
    "qwen3-vl": Family(
        model_cls=Qwen3VLForConditionalGeneration,
        processor_cls=Qwen3VLProcessor,
        chat_template=qwen3_vl_chat_template,
        config=qwen3_vl_config,
        patch_size=16,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        added_tokens=QWEN3_ADDED,
        generation=QWEN3_VL_GENERATION,
    ),
    # The template of Qwen3.5-4B and larger (the GeoQA seed's model): thinking unless `enable_thinking: false`.
    # Qwen3.5 has no published generation_config.json; its tokenizer_config.json names `Qwen2Tokenizer`.
    "qwen3.5": Family(
        model_cls=Qwen3_5ForConditionalGeneration,
        processor_cls=Qwen3VLProcessor,
        chat_template=qwen3_5_think_chat_template,
        config=qwen3_5_config,
        patch_size=16,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        added_tokens=QWEN3_ADDED,
        tokenizer_rules=qwen3_5_rules,
        hub_tokenizer_class="Qwen2Tokenizer",
    ),
}
# Pixel limits of the replicas, in image tokens per side: between 2x2 and 6x6 tokens (28- or 32-pixel cells).
MIN_CELLS, MAX_CELLS = 2, 6


def pixel_limits(family: Family) -> tuple[int, int]:
    """The replica's (min_pixels, max_pixels): 2x2 to 6x6 image tokens of the family's cell size."""
    return (MIN_CELLS * family.cell) ** 2, (MAX_CELLS * family.cell) ** 2
