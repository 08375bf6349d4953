"""The embedded default models: tiny replicas of Qwen2.5-VL, Qwen3-VL and Qwen3.5, built locally so that every recipe
runs offline on a CPU, on each family the recipes name.

Nothing here is downloaded. Each replica has its family's architecture class and the config features that set the
family apart (Qwen3.5's mix of linear- and full-attention layers, Qwen3-VL's deepstack vision features, each family's
multimodal rotary sections), the family's real chat template (the text TRL ships and recognises by string equality),
its processor class and image-processor settings (patch size, merge size, normalisation), Qwen's special tokens with
their names and roles, and the family's published generation defaults. Only the sizes are toy and the weights random.
The tokenizer is a byte-level BPE trained with `tokenizers` on a small generated corpus. Everything is saved with
`save_pretrained`, so a replica loads through exactly the code that loads `Qwen/Qwen3.5-4B`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
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
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from trl.chat_template_utils import (
    qwen2_5_vl_chat_template,
    qwen3_5_think_chat_template,
    qwen3_vl_chat_template,
)

from vision_grpo.processing import image_only_processor_class

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
    generation: dict[str, Any] = field(default_factory=dict)

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


# The toy sizes the two Qwen3 families share: a 64-wide, 2-layer text model (GQA 4/2) and a 32-wide, 2-block vision
# tower with 16-pixel patches merged 2x2 and learned position embeddings on an 8x8 grid.
QWEN3_TOY_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
QWEN3_TOY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
}


def qwen3_vl_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3VLConfig:
    """Qwen3-VL at toy size: interleaved mrope over a 16-dim head, and a deepstack merger feeding vision block 1's
    features into the language model."""
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
        vision_config={**QWEN3_TOY_VISION, "deepstack_visual_indexes": [1]},
        **_token_ids(tokenizer),
        tie_word_embeddings=True,
    )


def qwen3_5_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3_5Config:
    """Qwen3.5 at toy size: one Gated-DeltaNet linear-attention layer then one gated full-attention layer (two
    layers all linear would break the dynamic cache), partial rotary (1/4 of the head) with interleaved mrope."""
    return Qwen3_5Config(
        text_config={
            **_text_ids(tokenizer),
            **QWEN3_TOY_TEXT,
            "layer_types": ["linear_attention", "full_attention"],
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
    # Qwen3.5 has no published generation_config.json.
    "qwen3.5": Family(
        model_cls=Qwen3_5ForConditionalGeneration,
        processor_cls=Qwen3VLProcessor,
        chat_template=qwen3_5_think_chat_template,
        config=qwen3_5_config,
        patch_size=16,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        added_tokens=QWEN3_ADDED,
    ),
}
# Pixel limits of the replicas, in image tokens per side: between 2x2 and 6x6 tokens (28- or 32-pixel cells).
MIN_CELLS, MAX_CELLS = 2, 6


def pixel_limits(family: Family) -> tuple[int, int]:
    """The replica's (min_pixels, max_pixels): 2x2 to 6x6 image tokens of the family's cell size."""
    return (MIN_CELLS * family.cell) ** 2, (MAX_CELLS * family.cell) ** 2


def _tokenizer_corpus(seed: int) -> list[str]:
    """Text the tiny tokenizer is trained on: shape-counting answers, GeoQA-style prompts and boxed answers."""
    rng = random.Random(seed)
    shapes = ["triangle", "circle", "square", "triangles", "circles", "squares", "red", "blue", "green"]
    words = [
        "How many",
        "are in the image?",
        "I see",
        "so the answer is",
        "The answer is",
        "therefore",
        "total",
        "the count is",
        "Answer with",
        "and",
        "There",
        "is",
        "are",
        "one",
        "two",
        "three",
        "also",
    ]
    lines = []
    for _ in range(2000):
        n = rng.randint(0, 9)
        lines.append(
            f"{rng.choice(words)} {n} {rng.choice(shapes)}, {rng.choice(words)} \\boxed{{{n}}}. "
            f"\\boxed{{{rng.choice('ABCD')}}} {rng.choice(words)}."
        )
    lines.append("You are a helpful assistant.")
    lines.append(
        "请根据图片解答下面的几何选择题。题目：选项：请先进行简单逻辑推理思考，再给出最终答案。最终选项格式必须是"
    )
    lines.append("如图，在△ABC中，∠ACB=90°，AB=5，则BC的长为（） 度 cm 圆 直线 平行 垂直 三角形 相交 于点")
    return lines


def build_tokenizer(family: Family, seed: int = 0, vocab_size: int = 450) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (digits one per token), add Qwen's special and added tokens and the family's template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(seed), trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in family.added_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=family.chat_template,
        padding_side="left",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )


def build_processor(family: Family, tokenizer: PreTrainedTokenizerFast, min_pixels: int, max_pixels: int):
    """The family's processor class, image-only (no video processor: that needs torchvision), with its image
    processor's patch size and normalisation and the given pixel limits."""
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=family.patch_size,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=family.image_mean,
        image_std=family.image_std,
    )
    return image_only_processor_class(family.processor_cls)(
        image_processor, tokenizer, chat_template=tokenizer.chat_template
    )


def build_replica(family_name: str, output_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny replica of `family_name` deterministically for `seed` and save it to `output_dir`.

    Written to a temporary folder first and renamed at the end, so an interrupted build never leaves a folder
    that looks complete.
    """
    family = FAMILIES[family_name]
    output_dir = Path(output_dir)
    staging = output_dir.with_name(output_dir.name + ".partial")
    tokenizer = build_tokenizer(family, seed)
    torch.manual_seed(seed)
    model = family.model_cls(family.config(tokenizer))
    ids = tokenizer.convert_tokens_to_ids
    model.generation_config = GenerationConfig(
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
        pad_token_id=ids("<|endoftext|>"),
        **family.generation,
    )
    processor = build_processor(family, tokenizer, *pixel_limits(family))
    staging.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging)
    processor.save_pretrained(staging)
    staging.rename(output_dir)
    return output_dir
