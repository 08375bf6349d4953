"""The embedded default models: tiny replicas of Qwen2.5-VL, Qwen3-VL and Qwen3.5, built locally so that every
recipe runs offline on a CPU, on each family the recipes name.

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
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vision_grpo.models.processing import image_only_processor_class
from vision_grpo.models.replicas.families import FAMILIES, SPECIAL_TOKENS, Family, pixel_limits


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
