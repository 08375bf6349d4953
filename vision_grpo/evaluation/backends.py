"""The evaluator of a recipe on the generation backend asked for: the model (with its verified adapter), processor
and rewards exactly as the recipe's training run built them, generating with transformers (`Evaluator`, on this
process's device) or with a vLLM engine (`VLLMEvaluator`, which loads no HF weights).
"""

from __future__ import annotations

from typing import Any

from accelerate import PartialState

from vision_grpo.evaluation.adapters import load_verified_adapter
from vision_grpo.evaluation.evaluator import Evaluator
from vision_grpo.models.loading import get_processor, load_model
from vision_grpo.plugins.rewards import get_recipe_rewards


def place_model(eval_args: Any) -> Any:
    """Where `from_pretrained` puts the model: this process's accelerator (GPU or MPS) when there is one, else the
    CPU; `--device_map auto` spreads one model over every GPU (one process)."""
    state = PartialState()
    if eval_args.device_map == "auto":
        if state.num_processes > 1:
            raise ValueError("device_map auto spreads one model over all GPUs: run one process, not accelerate launch")
        return "auto"
    return None if state.device.type == "cpu" else {"": state.device}


def build_evaluator(task_args: Any, train_args: Any, model_args: Any, eval_args: Any) -> tuple[Evaluator, Any]:
    """Model (+ verified adapter), processor and rewards exactly as the recipe's training run built them.

    `eval_args` says which adapter (`adapter`, `merge_adapter`), where the model goes (`device_map`) and which
    generation backend (`backend`: `hf`, or `vllm` for vision_grpo/evaluation/vllm_backend.py, which loads no HF
    weights: the engine holds the only copy): the evaluation's `EvalArguments`.
    """
    processor = get_processor(model_args, task_args, train_args.trust_remote_code)
    rewards = get_recipe_rewards(task_args, processor.tokenizer)
    common = (processor, task_args.task, rewards, train_args.chat_template_kwargs or {})
    if eval_args.backend == "vllm":
        from vision_grpo.evaluation.vllm_backend import VLLMEvaluator  # imports vLLM: only for this backend

        vllm_args = {
            "adapter": eval_args.adapter,
            "merge": eval_args.merge_adapter,
            "tensor_parallel_size": eval_args.tensor_parallel_size,
        }
        evaluator = VLLMEvaluator(
            *common, model_args=model_args, trust_remote_code=train_args.trust_remote_code, **vllm_args
        )
        return evaluator, processor
    model = load_model(model_args, train_args.trust_remote_code, device_map=place_model(eval_args))
    if eval_args.adapter:
        model = load_verified_adapter(model, eval_args.adapter, merge=eval_args.merge_adapter)
    return Evaluator(model, *common), processor
