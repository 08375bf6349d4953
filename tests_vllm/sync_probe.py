"""Run the training entry point and, at the start of each step's vLLM generation (after TRL's own weight sync),
score one fixed prompt, image and completion in the engine and in the trained policy; write both to a JSON file.

    python tests_vllm/cpu_launch.py --vllm-dtype float32 tests_vllm/sync_probe.py OUT.json [--no-sync] \
        recipes/train.py --config recipes/shapes/tiny_cpu_vllm_colocate.yaml ...

OUT.json: a list, one entry per generation call, of `{"engine": [...], "policy": [...]}`, the log-probability of each
completion token. `--no-sync` makes the weight sync do nothing (the run the test must catch).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw
from vllm import SamplingParams

from vision_grpo.training.vllm_generation import VisionVLLMGeneration

COMPLETION = "There are 2 circles. The answer is \\boxed{2}."


def probe_image() -> Image.Image:
    """Not a training image: two circles and a square on grey."""
    image = Image.new("RGB", (112, 112), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    draw.ellipse((10, 10, 40, 40), fill=(220, 30, 30))
    draw.ellipse((60, 60, 95, 95), fill=(220, 30, 30))
    draw.rectangle((65, 10, 100, 35), fill=(30, 30, 220))
    return image


def probe_inputs(processor: Any) -> tuple[dict[str, torch.Tensor], Image.Image, int]:
    """The processor's inputs for prompt + completion, the image, and how many completion tokens end them."""
    image = probe_image()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    completion = processor.tokenizer(COMPLETION, add_special_tokens=False)["input_ids"]
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    length = inputs["input_ids"].shape[1]
    tails = {"input_ids": completion, "attention_mask": [1] * len(completion)}  # any other per-token key: 0, text
    for key, value in inputs.items():
        if value.dim() == 2 and value.shape[1] == length:
            tail = tails.get(key, [0] * len(completion))
            inputs[key] = torch.cat([value, torch.tensor([tail], dtype=value.dtype)], dim=1)
    return inputs, image, len(completion)


@torch.no_grad()
def policy_logprobs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], count: int) -> list[float]:
    """The trained policy's log-probability of each of the last `count` tokens, in eval mode (no LoRA dropout)."""
    training = model.training
    model.eval()
    logits = model(**inputs).logits[0, -count - 1 : -1].float()
    model.train(training)
    targets = inputs["input_ids"][0, -count:]
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0].tolist()


def engine_logprobs(generation: VisionVLLMGeneration, inputs: dict[str, torch.Tensor], image: Any, count: int):
    """The engine's log-probability of the same tokens (prompt log-probabilities of prompt + completion)."""
    request = {"prompt_token_ids": inputs["input_ids"][0].tolist(), "multi_modal_data": {"image": image}}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    (output,) = generation.llm.llm.generate([generation.llm.engine_prompt(request)], params, use_tqdm=False)
    targets = request["prompt_token_ids"][-count:]
    return [entry[token].logprob for entry, token in zip(output.prompt_logprobs[-count:], targets, strict=True)]


def install(out: Path) -> None:
    """Score the probe at the start of every `generate` call, appending to `out`."""
    generate = VisionVLLMGeneration.generate
    records: list[dict[str, list[float]]] = []

    def probed_generate(self: VisionVLLMGeneration, *args: Any, **kwargs: Any) -> Any:
        inputs, image, count = probe_inputs(self.processing_class)
        policy = policy_logprobs(self.model, inputs, count)
        records.append({"engine": engine_logprobs(self, inputs, image, count), "policy": policy})
        out.write_text(json.dumps(records))
        return generate(self, *args, **kwargs)

    VisionVLLMGeneration.generate = probed_generate


def main() -> None:
    out, *args = sys.argv[1:]
    if args[0] == "--no-sync":
        VisionVLLMGeneration.sync_weights = lambda self: None
        args = args[1:]
    install(Path(out))
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
