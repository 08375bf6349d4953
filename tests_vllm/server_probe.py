"""Run the training entry point in TRL's server mode against a real vLLM server, up to the weight transfer, and write
what crossed the wire and what the trained policy scores to a JSON file.

    python tests_vllm/server_probe.py OUT.json recipes/train.py --config RECIPE --vllm_mode server \
        --vllm_server_base_url http://127.0.0.1:PORT --max_steps 1 ...

Two things a CPU cannot do are replaced, and recorded, nothing else:
- `VLLMClient.init_communicator` (TRL 1.16, `trl/generation/vllm_client.py`) runs as is; on CPU it raises
  `NotImplementedError` (it needs a CUDA device for vLLM's NCCL weight-transfer engine) before it contacts the server's
  `/init_weight_transfer_engine`; the probe records the device and the error and lets the trainer go on without a
  communicator.
- `VisionVLLMGeneration.sync_weights` in server mode would broadcast the weights over that NCCL group
  (`update_named_params` -> `packed_nccl_broadcast_producer`). TRL calls it before the first generation (its
  `_last_loaded_step` starts at -1), when the policy is the checkpoint the server loaded plus fresh LoRA adapters
  (every `lora_B` zero, so the merged weights are the checkpoint's). The probe skips that one call only after checking
  every `lora_B` is zero, and refuses any other: a run here must stop after its first step (`--max_steps 1`).

OUT.json: `{"init_communicator": {...}, "syncs": [...], "requests": [...], "generations": [...], "logs": [...]}`:
- `requests`: each `/inference/v1/generate` request TRL's client sent (token ids, `n`, image placeholders) with the
  number of choices that came back, and the number of `/v1/chat/completions/render` calls (image features);
- `generations`: each `VLLMGeneration.generate` call: the trainer's prompt ids, image sizes and G, what came back
  (prompt ids, completion ids, logprobs), and the trained policy's log-probabilities of the same completion tokens,
  scored by the trainer-side model (eval mode) with the recipe's processor, with and without the vision-token bias
  the server applies (the server returns `processed_logprobs`, so its logprobs are those of the biased distribution);
- `logs`: the trainer's logged dicts.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from trl.generation.vllm_client import VLLMClient

from vision_grpo.training.vllm_generation import VisionVLLMGeneration

RECORD: dict[str, Any] = {"init_communicator": None, "syncs": [], "requests": [], "renders": 0, "generations": []}
RECORD["logs"] = []


def write(out: Path) -> None:
    out.write_text(json.dumps(RECORD))


@torch.no_grad()
def policy_logprobs(generation: VisionVLLMGeneration, prompt: list[int], completion: list[int], images: list) -> dict:
    """The trainer-side policy's log-probability of each completion token after `prompt` with `images`, biased as
    the server's sampling is (the logit bias of `generation`) and unbiased."""
    processor = generation.processing_class
    model = generation.model
    ids = torch.tensor([prompt + completion])
    vision = processor.image_processor(images=images, return_tensors="pt")
    # What the processor returns beside input_ids for Qwen-VL: 1 on image tokens, which selects 3-D (M-RoPE) positions.
    token_types = (ids == processor.image_token_id).long()
    training = model.training
    model.eval()
    logits = (
        model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=vision["pixel_values"],
            image_grid_thw=vision["image_grid_thw"],
            mm_token_type_ids=token_types,
        )
        .logits[0, len(prompt) - 1 : -1]
        .float()
    )
    model.train(training)
    targets = torch.tensor(completion)[:, None]
    unbiased = torch.log_softmax(logits, dim=-1).gather(1, targets)[:, 0]
    for token, bias in generation.generation_kwargs.get("logit_bias", {}).items():
        logits[:, int(token)] += bias
    biased = torch.log_softmax(logits, dim=-1).gather(1, targets)[:, 0]
    return {"biased": biased.tolist(), "unbiased": unbiased.tolist()}


def install(out: Path) -> None:
    init_communicator = VLLMClient.init_communicator

    def probed_init_communicator(self: VLLMClient, device: Any = 0) -> None:
        try:
            init_communicator(self, device=device)
        except NotImplementedError as error:
            RECORD["init_communicator"] = {"device": str(device), "error": str(error)}
            write(out)
            return
        RECORD["init_communicator"] = {"device": str(device), "error": None}

    def probed_sync_weights(self: VisionVLLMGeneration) -> None:
        if self.mode != "server":
            raise RuntimeError("server_probe.py runs server mode only")
        lora_b = [param for name, param in self.model.named_parameters() if "lora_B" in name]
        zero = bool(lora_b) and all(bool((param == 0).all()) for param in lora_b)
        if RECORD["syncs"] or not zero:
            raise RuntimeError(
                "a weight transfer to the server is needed here (the policy differs from the server's checkpoint); "
                "it runs over NCCL, which this CPU machine cannot: run one step (--max_steps 1)"
            )
        RECORD["syncs"].append({"skipped": True, "lora_B_tensors": len(lora_b), "all_zero": zero})
        write(out)

    post = VLLMClient._post

    def probed_post(self: VLLMClient, url: str, **kwargs: Any) -> dict:
        response = post(self, url, **kwargs)
        if url.endswith("/inference/v1/generate"):
            body = kwargs["json"]
            RECORD["requests"].append(
                {
                    "token_ids": body["token_ids"],
                    "n": body["sampling_params"]["n"],
                    "logit_bias": body["sampling_params"].get("logit_bias"),
                    "placeholders": (body.get("features") or {}).get("mm_placeholders"),
                    "choices": len(response["choices"]),
                }
            )
        return response

    render = VLLMClient.image_features

    def probed_image_features(self: VLLMClient, images: list, *args: Any, **kwargs: Any) -> list:
        RECORD["renders"] += sum(1 for prompt_images in images if prompt_images)
        return render(self, images, *args, **kwargs)

    generate = VisionVLLMGeneration.generate

    def probed_generate(self: VisionVLLMGeneration, prompts: list, images: Any, num_generations: int, *args, **kw):
        result = generate(self, prompts, images, num_generations, *args, **kw)
        prompt_ids, completion_ids, logprobs, _ = result
        record = {
            "prompts": [list(prompt) for prompt in prompts],
            "image_sizes": [[list(image.size) for image in prompt_images or []] for prompt_images in images or []],
            "num_generations": num_generations,
            "image_token_id": self.processing_class.image_token_id,
            "prompt_ids": [list(ids) for ids in prompt_ids],
            "completion_ids": [list(ids) for ids in completion_ids],
            "logprobs": [[position[0] for position in sample] for sample in logprobs],
            "policy": [
                policy_logprobs(self, list(prompt), list(completion), prompt_images or [])
                for prompt, completion, prompt_images in zip(prompt_ids, completion_ids, images, strict=True)
            ],
        }
        RECORD["generations"].append(record)
        write(out)
        return result

    log = transformers.Trainer.log

    def probed_log(self: transformers.Trainer, logs: dict, *args: Any, **kwargs: Any) -> None:
        RECORD["logs"].append({key: value for key, value in logs.items() if isinstance(value, (int, float))})
        write(out)
        return log(self, logs, *args, **kwargs)

    VLLMClient.init_communicator = probed_init_communicator
    VLLMClient._post = probed_post
    VLLMClient.image_features = probed_image_features
    VisionVLLMGeneration.sync_weights = probed_sync_weights
    VisionVLLMGeneration.generate = probed_generate
    transformers.Trainer.log = probed_log


def main() -> None:
    out, *args = sys.argv[1:]
    install(Path(out))
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
