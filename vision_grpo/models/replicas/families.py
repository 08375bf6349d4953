"""The embedded default models: tiny replicas of Qwen2.5-VL, Qwen3-VL and Qwen3.5, built locally so that every recipe
runs offline on a CPU, on each family the recipes name.

Nothing here is downloaded. Each replica has its family's architecture class and the config features that set the
family apart (Qwen3.5's mix of linear- and full-attention layers, Qwen3-VL's deepstack vision features, each family's
multimodal rotary sections), the family's real chat template (the text TRL ships and recognises by string equality),
its processor class and image-processor settings (patch size, merge size, normalisation), Qwen's special tokens with
their names and roles, and the family's published generation defaults. Only the sizes are toy and the weights random.
The tokenizer is a byte-level BPE trained with `tokenizers` on a small generated corpus. Everything is saved with
`save_pretrained`, then put in the form the family's Hub repository has, so a replica loads through exactly the code
that loads `Qwen/Qwen3.5-4B`: Qwen2.5-VL's `config.json` in the older flat form (transformers converts it on every
load), with a vocabulary padded past the tokenizer's as the Hub's; Qwen3.5's tokenizer under the class name its Hub
`tokenizer_config.json` gives (`Qwen2Tokenizer`, which transformers replaces by `Qwen3_5Tokenizer`: NFC normaliser and
its own pre-tokenizer regex) and no `generation_config.json`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
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
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX as QWEN3_5_PRETOKENIZE_REGEX
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
    """Train a byte-level BPE under the family's splitting rules, add Qwen's special and added tokens and the family's
    template."""
    tokenizer = Tokenizer(models.BPE())
    family.tokenizer_rules(tokenizer)
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


def _padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """A transformers-5 nested Qwen2.5-VL config in the flat form of the Hub's `config.json`: the text keys at the top
    level, the rotary settings as `rope_theta` and an `mrope` `rope_scaling`, `torch_dtype` for `dtype`.
    `Qwen2_5_VLConfig` rebuilds the nested form from it on load."""
    flat = {key: value for key, value in config.items() if key not in ("text_config", "dtype")}
    text = {key: value for key, value in config["text_config"].items() if key not in ("model_type", "dtype")}
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope["rope_theta"]
    text["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    for key, value in text.items():
        flat.setdefault(key, value)
    flat["torch_dtype"] = config["dtype"]
    return flat


def _as_on_the_hub(family: Family, folder: Path) -> None:
    """Rewrite what `save_pretrained` wrote into the form the family's Hub repository has (see the module doc)."""
    if family.flat_config:
        config_file = folder / "config.json"
        config_file.write_text(json.dumps(flat_config(json.loads(config_file.read_text())), indent=2) + "\n")
    if family.hub_tokenizer_class:
        tokenizer_config = folder / "tokenizer_config.json"
        settings = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        settings["tokenizer_class"] = family.hub_tokenizer_class
        tokenizer_config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if family.generation is None:
        (folder / "generation_config.json").unlink()


def build_replica(family_name: str, output_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny replica of `family_name` deterministically for `seed` and save it to `output_dir`.

    The vocabulary is padded after the weights are drawn: the rows of the tokenizer's tokens are the ones an unpadded
    build has, and the padding rows come from the model's own initialiser. Written to a temporary folder first and
    renamed at the end, so an interrupted build never leaves a folder that looks complete.
    """
    family = FAMILIES[family_name]
    output_dir = Path(output_dir)
    staging = output_dir.with_name(output_dir.name + ".partial")
    tokenizer = build_tokenizer(family, seed)
    torch.manual_seed(seed)
    model = family.model_cls(family.config(tokenizer))
    if family.vocab_multiple > 1:
        model.resize_token_embeddings(_padded(len(tokenizer), family.vocab_multiple), mean_resizing=False)
    ids = tokenizer.convert_tokens_to_ids
    model.generation_config = GenerationConfig(
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
        pad_token_id=ids("<|endoftext|>"),
        **(family.generation or {}),
    )
    processor = build_processor(family, tokenizer, *pixel_limits(family))
    staging.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging)
    processor.save_pretrained(staging)
    _as_on_the_hub(family, staging)
    staging.rename(output_dir)
    return output_dir
