"""Memory plan of a recipe: the expected peak GPU memory per rank, part by part, before anything is loaded.

    python -m vision_grpo.plan --config recipes/geoqa/qwen3_5_4b_lora.yaml [--num_processes N]
        [--accelerate_config accelerate_configs/zero3.yaml] [--image_pixels P] [--prompt_text_tokens T]
        [--images_per_prompt K] [--key value ...]

It reads the model's config only (a local folder's config.json, a copy shipped in vision_grpo/model_configs/ for the
shipped GPU recipes, or the Hugging Face cache), builds the model on the meta device to count its parameters, and
applies vision_grpo/memory_formulas.py. Training prints the same plan and refuses to start when it exceeds the GPU
that is present (recipe key `memory_plan_check: false` skips the refusal). docs/memory.md compares each part with
measurements and says what only a GPU run can confirm.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from vision_grpo import memory_formulas as mf
from vision_grpo.config import RecipeError

logger = logging.getLogger("vision_grpo.plan")
GiB = 1024**3
CARDS_GIB = (24, 48, 80, 141)
# HF generate's phases, one after the other: the vision tower encodes every image of the call, the prefill runs the
# prompts (their cache built), the decoding grows the cache by the completions. "generate" parts last through the
# prefill and the decoding.
GENERATION = ("encode", "prefill", "decode")
PHASES = ("train", *GENERATION)
SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"
DEFAULT_PROMPT_TEXT_TOKENS = 256  # an assumption, printed with the plan: system prompt + question, without images
DEFAULT_IMAGE_PIXELS = 1003520  # transformers' Qwen2-VL image processor cap, used when a recipe sets no max_pixels


@dataclass
class Part:
    name: str
    bytes: float
    phase: str  # "both", "train" (forward + backward of one micro-batch), or a generation phase (GENERATION)
    key: str  # the recipe key that changes it first
    note: str = ""


@dataclass
class Plan:
    model: str
    sizes: str
    parts: list[Part] = field(default_factory=list)
    vllm_share: float = 0.0  # vllm_gpu_memory_utilization of colocated vLLM: a share of whatever card it runs on

    def in_phase(self, part: Part, phase: str) -> bool:
        return part.phase in ("both", phase) or (part.phase == "generate" and phase in ("prefill", "decode"))

    def phase_total(self, phase: str) -> float:
        return sum(p.bytes for p in self.parts if self.in_phase(p, phase))

    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_total)

    def total(self, card_bytes: float | None = None) -> float:
        """Peak per rank: the largest phase, training or one of generation's (plus vLLM's share of the card)."""
        peak = self.phase_total(self.peak_phase())
        return peak + (self.vllm_share * card_bytes if card_bytes else 0.0)

    def fits(self, card_bytes: float) -> bool:
        return self.total(card_bytes) <= card_bytes

    def first_key(self, card_bytes: float | None = None) -> str:
        """The recipe key to change first: the one of the largest part of the phase that sets the peak."""
        phase = self.peak_phase()
        candidates = [p for p in self.parts if self.in_phase(p, phase)]
        if self.vllm_share and card_bytes:
            candidates.append(Part("vLLM", self.vllm_share * card_bytes, "both", "vllm_gpu_memory_utilization"))
        return max(candidates, key=lambda p: p.bytes).key

    def lines(self) -> list[str]:
        """The plan as printed: one line per part, the total, and the cards it fits."""
        out = [f"memory plan for {self.model} ({self.sizes}), per GPU rank:"]
        for p in self.parts:
            out.append(f"  {p.name:<44} {p.bytes / GiB:7.2f} GiB  [{p.phase}]  {p.note}".rstrip())
        phases = [p for p in PHASES if any(part.phase in (p, "generate") for part in self.parts) or p == "train"]
        totals = ", ".join(f"{p} {self.phase_total(p) / GiB:.2f}" for p in phases)
        out.append(f"  {f'peak ({self.peak_phase()} phase)':<44} {self.total() / GiB:7.2f} GiB  phases: {totals} GiB")
        if self.vllm_share:
            out.append(f"  + colocated vLLM: vllm_gpu_memory_utilization {self.vllm_share} of the card")
        for card in CARDS_GIB:
            verdict = "fits" if self.fits(card * GiB) else f"does not fit: change `{self.first_key(card * GiB)}` first"
            out.append(f"  {card:>3} GiB card: {self.total(card * GiB) / GiB:6.2f} GiB, {verdict}")
        return out


def model_config(name: str) -> Any:
    """The transformers config of `name`, never its weights: a local folder, a shipped copy, or the HF cache."""
    from transformers import AutoConfig

    from vision_grpo.modeling import EMBEDDED_MODELS, resolve_model_path

    if name in EMBEDDED_MODELS or Path(name).expanduser().is_dir():
        return AutoConfig.from_pretrained(resolve_model_path(name))
    shipped = SHIPPED_CONFIGS / f"{name.replace('/', '--')}.json"
    if shipped.is_file():
        return AutoConfig.from_pretrained(shipped)
    try:
        return AutoConfig.from_pretrained(name)
    except OSError as error:
        raise RecipeError(
            f"memory plan: no config for model `{name}` (not a local folder, not in {SHIPPED_CONFIGS}, not in the "
            f"Hugging Face cache): download its config.json or pass a local folder ({error})"
        ) from None


@contextlib.contextmanager
def _without_zero3_init() -> Iterator[None]:
    """Under a ZeRO-3 launch transformers partitions and initialises every model it builds, which fails on the meta
    device ("Cannot copy out of meta tensor"); counting parameters needs the plain module tree, so the HF DeepSpeed
    config is set aside (transformers keeps it as a module-level reference) while it is built."""
    from transformers.integrations import deepspeed

    saved = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = saved


def parameter_counts(config: Any, lora_rank: int, lora_on_vision: bool, targets: list[str] | None) -> dict[str, int]:
    """Parameters of the whole model, of its vision tower and of the LoRA adapters, counted on the meta device."""
    from transformers import AutoModelForImageTextToText

    from vision_grpo.modeling import is_vision_parameter

    with torch.device("meta"), _without_zero3_init():
        model = AutoModelForImageTextToText.from_config(config)
    output = model.get_output_embeddings()
    counts = {"total": sum(p.numel() for p in model.parameters()), "vision": 0, "lora": 0}
    counts["vision"] = sum(p.numel() for n, p in model.named_parameters() if is_vision_parameter(n))
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output:
            continue
        if is_vision_parameter(name) and not lora_on_vision:
            continue
        if targets and name.rsplit(".", 1)[-1] not in targets:
            continue
        counts["lora"] += lora_rank * (module.in_features + module.out_features)
    return counts


def accelerate_layout(path: str | None, num_processes: int | None) -> tuple[int, int]:
    """(processes, ZeRO stage) from an accelerate config file; `--num_processes` wins over the file."""
    stage, processes = 0, 1
    if path:
        content = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if content.get("distributed_type") == "DEEPSPEED":
            stage = int((content.get("deepspeed_config") or {}).get("zero_stage", 0))
        processes = int(content.get("num_processes", 1)) if content.get("distributed_type") != "NO" else 1
    return (num_processes or processes), stage


def image_pixels(task_args: Any, override: int | None) -> tuple[int, str]:
    """Pixels per image and where that figure came from."""
    if override:
        return override, "--image_pixels"
    if task_args.task == "shapes" and not (task_args.max_pixels and task_args.max_pixels < task_args.shapes_canvas**2):
        return task_args.shapes_canvas**2, f"shapes_canvas {task_args.shapes_canvas}px"
    if task_args.max_pixels:
        return task_args.max_pixels, "max_pixels"
    return DEFAULT_IMAGE_PIXELS, "no max_pixels in the recipe: transformers' default cap; set max_pixels"


def build_plan(
    task_args: Any,
    training_args: Any,
    model_args: Any,
    num_processes: int = 1,
    zero_stage: int = 0,
    pixels: int | None = None,
    prompt_text_tokens: int = DEFAULT_PROMPT_TEXT_TOKENS,
    images_per_prompt: int = 1,
    generation_batch_set: bool = False,
) -> Plan:
    """The plan of one recipe (its three parsed dataclasses) on `num_processes` ranks with a ZeRO stage."""
    config = model_config(model_args.model_name_or_path)
    shape = mf.shape_of(config)
    peft = bool(model_args.use_peft)
    rank = model_args.lora_r if peft else 0
    counts = parameter_counts(config, rank, task_args.lora_on_vision, model_args.lora_target_modules)
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}.get(str(model_args.dtype), 2)
    vision_trains = (peft and task_args.lora_on_vision) or (not peft and task_args.vision_tower != "freeze")
    trainable = counts["lora"] if peft else counts["total"] - (0 if vision_trains else counts["vision"])
    state_bytes = mf.FP32 if peft else dtype_bytes  # PEFT keeps adapters in float32; full fine-tuning the dtype

    pixels, pixels_from = image_pixels(task_args, pixels)
    patches, image_tokens = mf.image_tokens(shape, pixels)
    batch, completion = training_args.per_device_train_batch_size, training_args.max_completion_length
    prompt = prompt_text_tokens + images_per_prompt * image_tokens
    tokens = batch * (prompt + completion)
    if generation_batch_set:
        generated = training_args.generation_batch_size // num_processes
    else:
        generated = batch * training_args.steps_per_generation

    plan = Plan(
        model=model_args.model_name_or_path,
        sizes=f"micro-batch {batch} x ({prompt} prompt [{image_tokens} image tokens at {pixels} px, {pixels_from}; "
        f"{prompt_text_tokens} text, assumed] + {completion} completion) tokens, {generated} sequences generated "
        f"at once, {num_processes} process(es), ZeRO {zero_stage}",
    )
    shard = num_processes if zero_stage == 3 else 1
    plan.parts.append(
        Part(
            f"weights ({model_args.dtype}, {counts['total'] / 1e9:.2f} B params)",
            counts["total"] * dtype_bytes / shard,
            "both",
            "accelerate_config: zero3.yaml",
        )
    )
    if peft:
        plan.parts.append(
            Part(
                f"LoRA parameters (r={rank}, float32, {counts['lora'] / 1e6:.1f} M)",
                counts["lora"] * mf.FP32,
                "both",
                "lora_r",
            )
        )
    plan.parts.append(
        Part(
            "gradients",
            trainable * state_bytes / (num_processes if zero_stage >= 2 else 1),
            "train",
            "use_peft" if not peft else "lora_r",
        )
    )
    plan.parts.append(
        Part(
            "AdamW states",
            2 * trainable * state_bytes / (num_processes if zero_stage >= 1 else 1),
            "both",
            "use_peft" if not peft else "lora_r",
        )
    )

    layers = [mf.text_layer_bytes_per_token(shape, t, rank, i == 0) for i, t in enumerate(shape.layer_types)]
    full = sum(layers) * tokens + counts["lora"] * mf.BF16  # + autocast's bf16 copies of the adapters
    checkpointed = len(layers) * tokens * shape.hidden * mf.BF16 + max(layers) * tokens
    gc = bool(training_args.gradient_checkpointing)
    other = checkpointed if not gc else full
    plan.parts.append(
        Part(
            f"activations ({'with' if gc else 'without'} gradient checkpointing)",
            checkpointed if gc else full,
            "train",
            "per_device_train_batch_size" if gc else "gradient_checkpointing",
            f"{'without' if gc else 'with'} it: {other / GiB:.2f} GiB",
        )
    )
    if vision_trains:
        vision_patches = batch * images_per_prompt * patches
        block = mf.vision_block_bytes_per_patch(shape, rank)
        vision = (
            shape.vision_depth * vision_patches * shape.vision_hidden * mf.BF16 + block * vision_patches
            if gc
            else shape.vision_depth * block * vision_patches
        )
        plan.parts.append(Part(f"vision tower activations ({vision_patches} patches)", vision, "train", "max_pixels"))
    kept, transient = mf.head_bytes(shape, batch * completion, lm_head_trains=not peft)
    plan.parts.append(
        Part(
            f"log-probs: TRL fused head, vocabulary {shape.vocab}",
            kept + transient,
            "train",
            "per_device_train_batch_size",
            f"kept {kept / GiB:.2f} + tile and backward {transient / GiB:.2f}; full logits would be "
            f"{batch * (prompt + completion) * shape.vocab * mf.FP32 / GiB:.1f} GiB in float32",
        )
    )
    if training_args.use_vllm and training_args.vllm_mode == "colocate":
        plan.vllm_share = training_args.vllm_gpu_memory_utilization
    elif not training_args.use_vllm:
        state = generated * mf.linear_state_bytes_per_sequence(shape)
        prompts, completions = (generated * n * mf.kv_cache_bytes_per_token(shape) for n in (prompt, completion))
        key = "steps_per_generation (fewer sequences per generate call) or use_vllm"
        plan.parts.append(Part(f"generation cache, prompts ({generated} sequences)", prompts + state, "generate", key))
        plan.parts.append(Part("generation cache, completions", completions, "decode", key))
        # The vision tower encodes every image of the call, then the language model's prefill runs with the
        # encoded images (and the pixel patches) alive
        language = mf.prefill_bytes_per_sequence(shape, prompt, peft) + images_per_prompt * image_tokens * (
            mf.image_bytes_per_image_token(shape)
        )
        language = generated * language + counts["lora"] * mf.BF16  # + autocast's bf16 copies of the adapters
        pixels = 3 * shape.temporal_patch * shape.patch**2
        encode = generated * images_per_prompt * patches * (mf.vision_prefill_bytes_per_patch(shape) + mf.FP32 * pixels)
        plan.parts.append(Part("vision tower, encoding the call's images", encode, "encode", "max_pixels"))
        plan.parts.append(Part("generation prefill (language model)", language, "prefill", "steps_per_generation"))
    return plan


def recipe_plan(argv: list[str]) -> tuple[Plan, argparse.Namespace]:
    """Parse the plan's own flags, then the recipe (with its overrides) as training would, and build the plan."""
    from trl import GRPOConfig, ModelConfig

    from vision_grpo.config import TaskArguments, parse_recipe

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--num_processes", type=int)
    own.add_argument("--accelerate_config")
    own.add_argument("--image_pixels", type=int)
    own.add_argument("--prompt_text_tokens", type=int, default=DEFAULT_PROMPT_TEXT_TOKENS)
    own.add_argument("--images_per_prompt", type=int, default=1)
    flags, rest = own.parse_known_args(argv)
    # The plan runs anywhere: without `use_cpu` a bf16 recipe is refused by TrainingArguments on a machine with no GPU
    task_args, training_args, model_args = parse_recipe(
        (TaskArguments, GRPOConfig, ModelConfig), [*rest, "--use_cpu", "true"]
    )
    processes, stage = accelerate_layout(flags.accelerate_config, flags.num_processes)
    recipe = yaml.safe_load(Path(rest[rest.index("--config") + 1]).read_text()) if "--config" in rest else {}
    plan = build_plan(
        task_args,
        training_args,
        model_args,
        processes,
        stage,
        flags.image_pixels,
        flags.prompt_text_tokens,
        flags.images_per_prompt,
        generation_batch_set="generation_batch_size" in recipe or "--generation_batch_size" in rest,
    )
    return plan, flags


def check_before_training(task_args: Any, training_args: Any, model_args: Any) -> Plan | None:
    """Log the plan (main process) and refuse a run whose plan exceeds this GPU, before the model loads."""
    from accelerate import PartialState

    state = PartialState()
    try:
        plan = build_plan(task_args, training_args, model_args, state.num_processes)
    except (KeyError, AttributeError, ValueError) as error:  # a model family the formulas do not cover
        logger.warning("no memory plan for %s: %s", model_args.model_name_or_path, error)
        return None
    if state.is_main_process:
        for line in plan.lines():
            logger.info(line)
    if training_args.use_cpu or not torch.cuda.is_available() or not task_args.memory_plan_check:
        return plan
    device = torch.cuda.current_device()
    card = torch.cuda.get_device_properties(device).total_memory
    if not plan.fits(card):
        raise RecipeError(
            f"memory plan: {plan.total(card) / GiB:.1f} GiB expected per GPU, but this GPU "
            f"({torch.cuda.get_device_name(device)}) has {card / GiB:.1f} GiB; change `{plan.first_key(card)}` first "
            "(`python -m vision_grpo.plan --config <recipe>` shows every part), or set `memory_plan_check: false`"
        )
    return plan


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    if "--config" not in argv:
        print(
            "usage: python -m vision_grpo.plan --config <recipe> [--num_processes N] [--key value ...]", file=sys.stderr
        )
        return 2
    try:
        plan, _ = recipe_plan(argv)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("\n".join(plan.lines()))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
