"""vLLM generation that is correct for Qwen-VL prompts, in TRL's colocate and server modes.

Two upstream gaps, both reproduced against a real (CPU) vLLM build with the embedded model (the figures are in
docs/scaling.md with the command):

1. Prompt form (colocate). TRL renders each prompt with the processor, whose ids already hold one image token per
   image feature, and hands those ids with the image to the engine, which expands the placeholder again
   (huggingface/trl#6294, #6401; not fixed in TRL 1.16), so every image's tokens reach the engine twice. The policy
   then learns from samples drawn for another prompt. The engine must receive one placeholder per image and
   expand it itself, with the trainer's pixel limits, so that its expansion is the trainer's prompt exactly;
   `VisionPromptEngine` does that and checks the engine's prompt.
   Server mode already pairs the trainer's expanded ids with features the server computed; there the risk is a
   server whose pixel limits differ from the recipe's, which `VisionVLLMGeneration._place_features` refuses.
2. Copies (colocate). TRL sends each of a prompt's G copies as its own request with n = 1 (its server mode already
   sends each prompt once with n = G), so the engine encodes each image and prefills each prompt G times.
   `VisionPromptEngine` sends consecutive identical prompts (the same ids and the same pixels) once with n = G and
   hands TRL one output per copy, in TRL's order.
3. Vision tokens. TRL suppresses the image token only for HF generation; vLLM samples it, and training crashes a
   step later ("Image features and image tokens do not match"). A -100 logit bias on every vision special token
   (the ones `VisionGRPOTrainer` suppresses for HF generation) keeps vLLM from sampling them, in both modes.
4. Weight sync (colocate). TRL's sync loads each merged parameter with the engine model's `load_weights` as-is:
   a backend that repacks weights after loading (vLLM's CPU build; quantized kernels) leaves parameters without a
   `weight_loader` and the load fails, and vLLM keeps each image's vision-tower output across requests, so after a
   sync of LoRA on the vision tower it would reuse features of the old weights. `VisionVLLMGeneration.sync_weights`
   runs TRL's sync inside vLLM's layerwise reload and then empties the encoder cache
   (tests_vllm/test_weight_sync.py).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from trl.generation.vllm_generation import VLLMGeneration

from vision_grpo.models.vllm_prompts import (
    PromptMismatchError,
    check_engine_prompt,
    collapse_image_runs,
    pixel_kwargs,
    vision_logit_bias,
)

logger = logging.getLogger(__name__)


def _same_images(a: Any, b: Any) -> bool:
    """The same image data: the same objects, or PIL images (or lists of them) of equal size, mode and pixels."""
    if a is b:
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_images(x, y) for x, y in zip(a, b, strict=True))
    return all(hasattr(x, "tobytes") for x in (a, b)) and (a.size, a.mode, a.tobytes()) == (b.size, b.mode, b.tobytes())


def copy_groups(prompts: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(first index, count) of each run of consecutive identical prompts: the same token ids and the same images."""
    groups: list[tuple[int, int]] = []
    for index, prompt in enumerate(prompts):
        if groups:
            first, count = groups[-1]
            head = prompts[first]
            same_images = _same_images(
                head.get("multi_modal_data", {}).get("image"), prompt.get("multi_modal_data", {}).get("image")
            )
            if list(head["prompt_token_ids"]) == list(prompt["prompt_token_ids"]) and same_images:
                groups[-1] = (first, count + 1)
                continue
        groups.append((index, 1))
    return groups


class VisionPromptEngine:
    """TRL's colocated `vllm.LLM` with one change: prompts with images reach `generate` un-expanded, with the
    trainer's pixel limits, and the engine's expansion must equal the trainer's ids token for token.

    Everything else (`llm_engine`, `sleep`, `wake_up`, `reset_prefix_cache`, ...) is the engine's own.
    """

    def __init__(
        self, llm: Any, image_token_id: int, mm_processor_kwargs: dict[str, Any], share_copies: bool = True
    ) -> None:
        self.llm = llm
        self.image_token_id = image_token_id
        self.mm_processor_kwargs = mm_processor_kwargs
        self.share_copies = share_copies
        self.reported = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)

    def engine_prompt(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """The prompt as vLLM expects it: one placeholder per image, which the engine expands with the images."""
        if "multi_modal_data" not in prompt:
            return prompt
        return {
            **prompt,
            "prompt_token_ids": collapse_image_runs(list(prompt["prompt_token_ids"]), self.image_token_id),
            "mm_processor_kwargs": self.mm_processor_kwargs,
        }

    def generate(self, prompts: list[dict[str, Any]], *args: Any, **kwargs: Any) -> list[Any]:
        sampling = kwargs.get("sampling_params")
        groups = copy_groups(prompts) if self.share_copies and not args and getattr(sampling, "n", 0) == 1 else []
        if len(groups) < len(prompts) and groups:
            outputs = self._generate_once_per_prompt(prompts, groups, kwargs)
        else:
            outputs = self.llm.generate([self.engine_prompt(prompt) for prompt in prompts], *args, **kwargs)
        for prompt, output in zip(prompts, outputs, strict=True):
            check_engine_prompt(list(prompt["prompt_token_ids"]), list(output.prompt_token_ids), self.image_token_id)
        return outputs

    def _generate_once_per_prompt(
        self, prompts: list[dict[str, Any]], groups: list[tuple[int, int]], kwargs: dict[str, Any]
    ) -> list[Any]:
        """Each run of copies as one request with n = its count; one output per copy back, in the prompts' order."""
        params = []
        for _, count in groups:
            param = kwargs["sampling_params"].clone()
            param.n = count
            params.append(param)
        if not self.reported:
            self.reported = True
            logger.info("vLLM: %d prompts sent as %d requests, each with n = its copies", len(prompts), len(groups))
        requests = [self.engine_prompt(prompts[first]) for first, _ in groups]
        outputs = self.llm.generate(requests, **{**kwargs, "sampling_params": params})
        per_copy = []
        for output in outputs:
            for sample in output.outputs:
                single = copy.copy(output)
                single.outputs = [sample]
                per_copy.append(single)
        return per_copy


class VisionVLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` with the vision-token bias in both modes, the prompt fix in colocate mode and a pixel
    check in server mode. Applied to the trainer's instance after TRL built it (the engine is already running)."""

    @classmethod
    def of(cls, generation: VLLMGeneration, processor: Any, share_copies: bool = True) -> VisionVLLMGeneration:
        generation.__class__ = cls
        tokenizer = getattr(processor, "tokenizer", processor)
        generation.generation_kwargs["logit_bias"] = {
            **(generation.generation_kwargs.get("logit_bias") or {}),
            **vision_logit_bias(tokenizer),
        }
        if generation.mode == "colocate" and not isinstance(generation.llm, VisionPromptEngine):
            generation.llm = VisionPromptEngine(
                generation.llm, processor.image_token_id, pixel_kwargs(processor), share_copies
            )
        return generation

    def sync_weights(self) -> None:
        """TRL's sync; in colocate mode inside vLLM's layerwise reload, and the engine's encoder cache emptied after.

        The layerwise reload is what vLLM's own `reload_weights` puts around the same `load_weights` call: each
        layer is put back in checkpoint form, takes TRL's tensors, and is processed (repacked) again once its last
        weight is in, into the storage the engine already uses. TRL resets only the prefix cache; the encoder cache
        holds vision-tower outputs of the old weights, which the next prompt with the same image would reuse.
        """
        if self.mode != "colocate":
            return super().sync_weights()
        # vLLM is an optional dependency: importable whenever a colocated engine runs.
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner  # the worker TRL loads into
        initialize_layerwise_reload(runner.get_model())
        super().sync_weights()
        finalize_layerwise_reload(runner.get_model(), runner.model_config)
        self.llm.llm_engine.reset_encoder_cache()

    def _place_features(self, features: dict | None, prompt_ids: list[int]) -> dict | None:
        """TRL's placement of server-computed image features, refused when the server's image size (its own pixel
        limits) gives another token count than the trainer's prompt holds."""
        placed = super()._place_features(features, prompt_ids)
        if features is not None:
            served = [run["length"] for run in features["mm_placeholders"]["image"]]
            trained = [run["length"] for run in placed["mm_placeholders"]["image"]]
            if served != trained:
                raise PromptMismatchError(
                    f"the vLLM server made {served} image tokens of the images, the trainer's prompt holds {trained}: "
                    "start the server with the recipe's pixel limits, e.g. "
                    '--mm-processor-kwargs \'{"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}\''
                )
        return placed
