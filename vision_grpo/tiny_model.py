"""The embedded default model: a tiny Qwen2.5-VL built locally, so the whole pipeline runs offline on a CPU.

Nothing here is downloaded. The tokenizer is a byte-level BPE trained with `tokenizers` on a small generated
corpus plus Qwen's special tokens; the model has Qwen2.5-VL's architecture at toy size with random weights. Both
are saved in standard Hugging Face format, so they load through exactly the same code as `Qwen/Qwen2.5-VL-3B-Instruct`.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from vision_grpo.processing import build_image_only_processor

# Qwen's special tokens, in Qwen's order, so prompts render exactly as they do for the real models.
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

# Qwen2-VL's chat template, reduced to what the recipes use. It tests `part['type']` rather than key presence
# because `datasets` stores an image part as {"type": "image", "text": None}.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Pixel limits of the embedded model: 28-pixel cells (14-pixel patches merged 2x2), between 2x2 and 6x6 cells.
MIN_PIXELS = (2 * 28) ** 2
MAX_PIXELS = (6 * 28) ** 2


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
    lines.append(
        "请根据图片解答下面的几何选择题。题目：选项：请先进行简单逻辑推理思考，再给出最终答案。最终选项格式必须是"
    )
    lines.append("如图，在△ABC中，∠ACB=90°，AB=5，则BC的长为（） 度 cm 圆 直线 平行 垂直 三角形 相交 于点")
    return lines


def build_tokenizer(seed: int = 0, vocab_size: int = 450) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (digits one per token) and wrap it with Qwen's special tokens and chat template."""
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
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )


def build_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL at toy size: text hidden 128 x 2 layers, vision hidden 64 x 2 blocks (about 0.7 M parameters)."""
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
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
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def build_tiny_vlm(output_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny model, tokenizer and processor deterministically for `seed` and save them to `output_dir`.

    Written to a temporary folder first and renamed at the end, so an interrupted build never leaves a folder
    that looks complete.
    """
    output_dir = Path(output_dir)
    staging = output_dir.with_name(output_dir.name + ".partial")
    tokenizer = build_tokenizer(seed)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(build_config(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    processor = build_image_only_processor(tokenizer, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    staging.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging)
    processor.save_pretrained(staging)
    staging.rename(output_dir)
    return output_dir
