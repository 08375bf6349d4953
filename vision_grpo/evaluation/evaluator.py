"""The evaluator: greedy batched generation over the rows a task builds, with prompts rendered as training renders
them, scored by the task and by the recipe's rewards, one record per example.

Library code: `eval/evaluate.py` (the command), the held-out curves during training
(vision_grpo/training/holdout.py), pass@k (eval/pass_at_k.py) and the vLLM backend
(vision_grpo/evaluation/vllm_backend.py) all generate and score through it, so the numbers they report come from one
rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from PIL import Image
from transformers import GenerationConfig

from vision_grpo.data.prompts_and_images import fill_image
from vision_grpo.models.vision import vision_special_token_ids
from vision_grpo.plugins.tasks import get_task, task_of

SEED = 42  # torch's seed for every evaluation (greedy decoding does not draw; sampling for pass@k does)


def default_max_new_tokens(task_args: Any, train_args: Any) -> int:
    """The one rule for evaluation and the held-out curves, for every task: the task's own evaluation length if it
    declares one, else the recipe's `max_completion_length`, the length training samples (the GeoQA recipes set the
    seed's 1,024)."""
    return task_of(task_args).eval_max_new_tokens or train_args.max_completion_length


class Evaluator:
    """Greedy batched generation over prompts built by the training code, scored per example."""

    # Processes that generate each batch together (one sharded vLLM engine); the HF backend's each generate alone.
    tensor_parallel_size = 1

    def __init__(self, model: Any, processor: Any, task: str, reward_funcs: list, chat_template_kwargs: dict) -> None:
        self.model = model.eval()
        self.processor = processor
        self.score = get_task(task).score
        self.reward_funcs = reward_funcs
        self.chat_template_kwargs = chat_template_kwargs
        tokenizer = processor.tokenizer
        self.pad_id = tokenizer.pad_token_id
        # Generation stops at the tokenizer's and the model's EOS ids; a completion also ends at padding.
        self.stop_ids = sorted(
            {i for i in (tokenizer.eos_token_id, *_as_list(model.generation_config.eos_token_id)) if i is not None}
        )
        self.eos_ids = set(self.stop_ids) | ({self.pad_id} if self.pad_id is not None else set())
        self.suppress_ids = vision_special_token_ids(tokenizer)

    def placement(self) -> dict[str, str]:
        """The dtype and device type of the weights that generate (recorded in a result's metadata)."""
        return {"dtype": str(self.model.dtype).removeprefix("torch."), "device": self.model.device.type}

    def close(self) -> None:
        """Release what the generating side holds beyond this object; the HF model goes with the evaluator."""

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        """Greedy decoding, built here: no repetition penalty, top-k/top-p or length rule from the checkpoint."""
        return GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            suppress_tokens=self.suppress_ids or None,
        )

    def decoding(self, max_new_tokens: int) -> dict[str, Any]:
        """The generation config as recorded in a result's metadata: the values that differ from transformers'."""
        settings = self.generation_config(max_new_tokens).to_diff_dict()
        settings.pop("transformers_version", None)
        return settings

    def _render(self, rows: list[dict[str, Any]], images: list[Image.Image]) -> Any:
        """Padding goes to the processor through `processor_kwargs`; the chat-template switches stay keyword
        arguments, which is where transformers looks for template variables."""
        conversations = [fill_image(row["prompt"], image) for row, image in zip(rows, images, strict=True)]
        return self.processor.apply_chat_template(
            conversations,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs={"padding": True},
            **self.chat_template_kwargs,
        )

    def encode(self, rows: list[dict[str, Any]], images: list[Image.Image]) -> Any:
        """Model inputs for `rows` with `images` in their image slots, padded on the left, on the model's device.

        Every field the processor returns is kept, as TRL does in training: Qwen-VL models place their multimodal
        rotary positions with `mm_token_type_ids`; dropping it silently changes what the model sees.
        """
        return self._render(rows, images).to(self.model.device)

    def prompt_length(self, row: dict[str, Any], image: Image.Image) -> int:
        """Tokens of the rendered prompt, image tokens included: what batches are bucketed by.

        Counted without processing the images: the template's text, tokenized, with each image placeholder
        replaced by the number of image tokens the processor computes from the image's size (10x cheaper than
        rendering; a test checks it equals the rendered length).
        """
        text = self.processor.apply_chat_template(
            [fill_image(row["prompt"], image)], add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )[0]
        images = image if isinstance(image, list) else [image]
        sizes = self.processor._get_num_multimodal_tokens(image_sizes=[(each.height, each.width) for each in images])
        return len(self.processor.tokenizer(text)["input_ids"]) + sum(sizes["num_image_tokens"]) - len(images)

    @torch.inference_mode()
    def generate(
        self,
        rows: list[dict[str, Any]],
        images: list[Any],
        max_new_tokens: int,
        sampling: GenerationConfig | None = None,
    ) -> list[dict]:
        """Completions for `rows` with `images` in their image slots: text, token count, whether cut off.

        Greedy (`generation_config`), or with `sampling` (pass@k) its `num_return_sequences` completions per row,
        each row's next to each other. No rows, no completions: a rank with no batch left in a round still reaches
        the round's gather.
        """
        if not rows:
            return []
        inputs = self.encode(rows, images)
        config = sampling or self.generation_config(max_new_tokens)
        with only_generation_config(self.model, config):
            output = self.model.generate(**inputs, generation_config=config)
        return [self.completion(ids) for ids in output[:, inputs["input_ids"].shape[1] :].tolist()]

    def completion(self, ids: list[int]) -> dict[str, Any]:
        """Generated `ids` cut after the first EOS or padding: ids, text, token count, whether cut off."""
        end = next((i for i, token in enumerate(ids) if token in self.eos_ids), None)
        kept = ids if end is None else ids[: end + 1]
        return {
            "ids": kept,
            "text": self.processor.tokenizer.decode(kept, skip_special_tokens=True),
            "completion_tokens": len(kept),
            "hit_limit": end is None,
        }

    def record(self, row: dict[str, Any], generated: dict[str, Any]) -> dict[str, Any]:
        """One result record: id, gold, prediction, correct, tokens, cut off, text, reward parts.

        Rewards get every column of the row as TRL gives them in training (`image` and `id` too), one-item lists.
        """
        columns = {k: [v] for k, v in row.items() if k != "prompt"}
        completion = [[{"role": "assistant", "content": generated["text"]}]]
        rewards = {
            func.__name__: func(
                completions=completion, completion_ids=[generated["ids"]], prompts=[row["prompt"]], **columns
            )[0]
            for func in self.reward_funcs
        }
        return {
            "id": row["id"],
            **self.score(row, generated["text"]),
            "completion_tokens": generated["completion_tokens"],
            "hit_limit": generated["hit_limit"],
            "text": generated["text"],
            "rewards": rewards,
        }


@contextmanager
def only_generation_config(model: Any, config: GenerationConfig) -> Iterator[None]:
    """While generating, `config` is the model's own generation config too.

    transformers fills every value left unset in the config passed to `generate` from the model's
    `generation_config` (the checkpoint's file: Qwen2.5-VL ships a repetition penalty, top-k and top-p). With the
    model's config swapped for ours, nothing leaks in. A PEFT model generates with its base model's config.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = inner.generation_config
    inner.generation_config = config
    try:
        yield
    finally:
        inner.generation_config = saved


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
